"""A worker in a fresh process: started as `scripts/benchmark.py --worker SPEC`, its result read
from the line it prints."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.workers import WORKERS

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository
ENTRY = ROOT / "scripts" / "benchmark.py"  # the script every worker process runs
RESULT = "BENCHMARK-RESULT "  # the line that carries a worker's result


def start_worker(spec: dict[str, Any], threads: int | None) -> subprocess.Popen[str]:
    """A worker in a fresh process (`finish_worker` waits for its result). `threads`: its
    intra-op threads (OMP_NUM_THREADS). With `spec["code"]` (a `--against` export) the worker
    is that revision's benchmark.py, importing that revision's package."""
    from captioning.launch import fresh_launch_env

    env = fresh_launch_env(os.environ)  # a DDP worker sets up its own ranks
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    script = str(ENTRY)
    if spec.get("code"):
        script = str(Path(spec["code"]) / "scripts" / "benchmark.py")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [spec["code"], env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, script, "--worker", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            **own_process_group())  # a timeout stops its ranks


def own_process_group() -> dict[str, Any]:
    """`subprocess.Popen` arguments that put the child in a process group of its own (so that
    `os.killpg` stops it with its children), in the caller's session: a session of its own
    would outlive the caller on a machine that ends the caller's session."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # before 3.11


def export_revision(rev: str, dest: Path) -> Path:
    """The project's package and scripts at git revision `rev`, written under `dest`."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"],
                         capture_output=True, text=True, check=True).stdout.strip()
    out = dest / f"rev-{sha}"
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha,
                              "captioning", "scripts"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


WORKER_TIMEOUT_S = 3600.0


def finish_worker(proc: subprocess.Popen[str], kind: str,
                  timeout: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """The result of a `start_worker` process; RuntimeError (its stderr's tail logged) when
    it gave none, or when it ran past `timeout` seconds (a hung collective, say: then its
    process group is killed)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as e:  # the timeout, or Ctrl-C (which no longer reaches its group)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise RuntimeError(f"benchmark worker {kind} ran past {timeout:.0f} s; "
                               "killed") from None
        raise
    for line in stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    sys.stderr.write(stderr[-5000:])
    raise RuntimeError(f"benchmark worker {kind} failed (exit {proc.returncode})")


def run_worker(spec: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """Run one worker in a fresh process and return its result."""
    return finish_worker(start_worker(spec, threads), spec["kind"])


def run_as_worker(spec: dict[str, Any]) -> int:
    """`--worker SPEC`: run one worker, print its result (rank zero only, under DDP)."""
    logging.basicConfig(level=logging.WARNING)
    from captioning.allocator import keep_freed_memory

    keep_freed_memory()  # as the `captioning` command does
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    result = WORKERS[spec["kind"]](spec)
    from captioning.launch import launcher_rank_zero

    if launcher_rank_zero():
        print(RESULT + json.dumps(result), flush=True)
    return 0
