"""`make gpu-check`: the GPU tests and the speed figures of a CUDA machine, in one table.
The timed stages run in the order `--stages` gives (default: the order below).

    python scripts/gpu_check.py                     # CUDA: the paper configuration
    python scripts/gpu_check.py --cpu               # every stage at tiny sizes on the CPU
    python scripts/gpu_check.py --stages train,beam --coco-images 20000
    python scripts/gpu_check.py --stages tests,train,beam --headline-only --rounds 1 \
        --deadline-s 500 --json OUT.json   # a short lease's first call (docs/benchmarks.md)

Stages (rows of the table):

* `tests`: `pytest -m gpu` over the modules that hold GPU tests (passed, failed and skipped
  counts); on a GPU they run while the COCO-size cache is written;
* `train`: cached training at the paper configuration (VGG-19 14x14x512 grids, embedding and
  attention 512, LSTM 1800), batch 64 and 128, bf16-mixed and fp32: pairs/s, step time, data
  wait, peak GPU memory and GPU utilisation (mean over the timed steps); eager
  (`fast_path: off`), then the decoder's fast path (`graphs`: the fixed-shape pass as CUDA
  graphs) at bf16 batch 64 and 128 and fp32 batch 64, with its speed-up over eager. The
  bf16 batch-64 pair runs `--rounds` times, eager and fast path alternating, pooled, with a
  third row alongside: the fast path with the grids held on the GPU
  (`data.features_on_device`), its batches gathered there;
* `coco`: cached training (bf16-mixed, batch 64) from a COCO-size cache: 113,287 synthetic
  196x512 float16 grids (22.7 GB), or as many as 80% of the free disk holds (the row says how
  many). They are written through the feature cache's own build path, random grids standing in
  for the CNN, then dropped from the page cache (`posix_fadvise`), so the run reads the disk;
  then the same with the grids copied to the GPU first (`data.features_on_device`);
* `uncached`: training that decodes JPEGs (640x480, COCO's usual size) in 8 DataLoader workers
  and runs VGG-19 on every batch, with the share of step time spent waiting for data;
* `beam`: beam search captions/s at beam 3 and 5, 100 and 500 images per batch (bf16-mixed;
  `<end>` disabled, so that every caption runs 20 steps), by `decoding.beam_search`
  (`fast_beam: off`) and over fixed shapes, a step replayed as a CUDA graph (`graphs`), with
  its speed-up (off's rows first; a setting that raises is its own FAILED row);
* `overlay`: `captioning.viz.render_strips` strips/s on the device (64 captions x 16 words,
  224 px, 14x14 grid, bicubic);
* `profile`: the headline setting's eager and fast-path steps under `torch.profiler`
  (10 steps each): the GPU's busy time a step (its kernels' and copies' spans, overlaps
  counted once) against the step's period, and the top host ops. Busy time well below the
  period says the GPU waited for the host within the step. Then the fast path's host time
  by source file, under cProfile (its own 10 steps): where that host time goes;
* `ddp`: with 2 or more GPUs, cached training on all of them (DDP, bf16-mixed, batch 64 per
  GPU) and its scaling efficiency: global pairs/s / (GPUs x one GPU's pairs/s).

The training and beam rows are the benchmark's workers (`bench/workers.py`), each in a fresh
process, one after another (peaks are per row; no row disturbs another; beam search's four
settings share one). On CUDA a training step's time is its span on the GPU timeline (no sync per
step), and rates are medians over steps; "data wait" there is the time the GPU waited between
steps (from one step's end event to the next one's start: the copy, the loader and the loop's
host work) over the total, and the notes give the host's wait. The table ends with each stage's
seconds. Captions are synthetic COCO-like ones (10k-word vocabulary) over the shapes images.
`--cpu` (automatic without CUDA) runs every stage at tiny sizes (resnet18 at 64 px, 4x4 grid, a
32-unit decoder) in this process, with the GPU tests and a 2-process DDP run (gloo) in
subprocesses alongside: it checks the command, and its figures mean nothing. The exit status is
1 when a GPU test or a stage failed.

For a machine lent for minutes (docs/benchmarks.md has the whole device command, with the
wheels of `scripts/gpu_wheels.sh`): `--headline-only` keeps the train stage to its headline
rows, `--deadline-s` starts nothing after that many seconds (a running worker is killed then
with its process group, and the rows not run are listed as skipped; the GPU tests get at most
`TESTS_SHARE` of the time left), and `--json` is rewritten after every row and every pooled
round, so that a run stopped from outside keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the benchmark workers
import benchmark_overlays
from bench.data import make_base, make_coco_karpathy
from bench.process import WORKER_TIMEOUT_S, finish_worker, own_process_group, start_worker
from bench.report import describe_machine, summarize_train
from bench.workers import WORKERS, build_run

log = logging.getLogger("gpu_check")

ROOT = Path(__file__).resolve().parent.parent
#: Beam search's rows: `decoding.beam_search`, then the fixed shapes' step as a CUDA graph.
FAST_BEAMS = ("off", "graphs")
STAGES = ("tests", "train", "coco", "uncached", "beam", "overlay", "profile", "ddp")
COCO_TRAIN_IMAGES = 113_287  # Karpathy's COCO train split, restval included
TESTS_SHARE = 0.5  # with --deadline-s: of the time left when the GPU tests are waited for
PROFILE_STEPS = 10  # profiled steps of each profile row, after the warm-up
PROFILE_WARMUP = 12  # steps first: most length buckets compile before the profiled ones


@dataclass
class Check:
    """What every stage needs: the mode, the work folder, the workers' base spec, sizes."""

    cpu: bool
    work: Path
    base: dict[str, Any]
    threads: int | None
    coco_images: int
    fast_only: bool = False  # train stage: eager at bf16 and the base batch, then the fast path
    headline_only: bool = False  # train stage: the headline rows only
    rounds: int = 1  # of the headline pair: eager and fast path, bf16 at the base batch
    deadline: float | None = None  # time.monotonic() after which no row or stage starts
    json_path: Path | None = None  # rewritten after every row
    header: dict[str, Any] = field(default_factory=dict)  # the machine and settings
    rows: list[dict[str, Any]] = field(default_factory=list)
    rounds_done: list[dict[str, Any]] = field(default_factory=list)  # each pooled round, kept
    single: dict[tuple[str, int], float] = field(default_factory=dict)  # one device's pairs/s
    seconds: dict[str, float] = field(default_factory=dict)  # each stage's wall time
    failed: bool = False

    def left(self) -> float:
        """Seconds before the deadline (an hour a worker without one)."""
        return WORKER_TIMEOUT_S if self.deadline is None else self.deadline - time.monotonic()

    @property
    def fast_path(self) -> str:
        """The decoder's fast path of the uncached and COCO-size rows: the CUDA default."""
        return "off" if self.cpu else "graphs"

    @property
    def loader_workers(self) -> int:
        return 2 if self.cpu else 8

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        """A benchmark worker: in this process on the CPU, else in a fresh one, killed at the
        deadline (`PastDeadline`)."""
        if self.left() <= 0:
            raise PastDeadline("skipped")
        if self.cpu:
            return WORKERS[spec["kind"]](spec)
        try:
            return finish_worker(start_worker(spec, self.threads), spec["kind"],
                                 timeout=max(1.0, self.left()))
        except RuntimeError:
            if self.left() <= 0:
                raise PastDeadline("killed at --deadline-s") from None
            raise

    def train_spec(self, precision: str, batch: int, **kw: Any) -> dict[str, Any]:
        return {**self.base, "kind": "train", "attention": "soft", "cached": True,
                "num_workers": 0 if self.cpu else 4, "precision": precision,
                "batch_size": batch, "sample_gpu": not self.cpu, **kw}

    def add(self, stage: str, config: str, result: str = "", **cols: Any) -> None:
        self.rows.append({"stage": stage, "config": config, "result": result, **cols})
        log.info("row: %s | %s | %s | %s", stage, config, result, cols)  # the table: at the end
        self.save()

    def note(self, text: str) -> None:
        """Put `text` first in the last row's notes (and save)."""
        self.rows[-1]["notes"] = "; ".join(x for x in (text, self.rows[-1].get("notes")) if x)
        self.save()

    def keep_round(self, config: str, res: dict[str, Any]) -> None:
        """A round of a pooled row, saved as it comes: a run killed before the row is built
        keeps its rounds' figures."""
        s = summarize_train([res])
        self.rounds_done.append({"config": config, "pairs_per_s": s["captions_per_s"],
                                 "step_ms": s["step_ms"], "wait": s["wait"],
                                 "peak_mb": s["peak_mb"], "notes": res.get("notes", "")})
        self.save()

    def save(self) -> None:
        """The rows so far to `json_path`: a run killed at its time limit keeps them."""
        if self.json_path is not None:
            from captioning.atomic import write_json_atomic

            write_json_atomic(self.json_path, {
                "cpu": self.cpu, **self.header, "rows": self.rows, "rounds": self.rounds_done,
                "seconds": self.seconds}, indent=2)


class PastDeadline(Exception):
    """A row not run, or a worker killed, at `--deadline-s`: a skipped row, not a failure."""


# ---------------------------------------------------------------------------------------------
# Stages


def train_row(check: Check, stage: str, config: str, res: dict[str, Any] | list[dict[str, Any]],
              *, notes: str = "", world: int = 1) -> float:
    """Add a training row from a worker's result (or several rounds' results, pooled);
    returns its (global) pairs/s."""
    rounds = res if isinstance(res, list) else [res]
    s = summarize_train(rounds)
    rate = s["captions_per_s"] * world
    utils = [r["gpu_util"] for r in rounds if r.get("gpu_util") is not None]
    util = sum(utils) / len(utils) if utils else None  # the rounds' mean
    if len(rounds) > 1:
        per = ", ".join(f"{x * world:.0f}" for x in s["per_round_captions_per_s"])
        notes = "; ".join(x for x in (notes, f"{len(rounds)} rounds (means {per})") if x)
    if s["wait_on"] == "gpu":  # the GPU's own wait is the column; the host's stays in notes
        notes = "; ".join(x for x in (notes, f"host wait {100 * s['host_wait']:.1f}%") if x)
    check.add(stage, config, f"{rate:.1f} pairs/s", step_ms=f"{s['step_ms']:.0f}",
              wait=f"{100 * s['wait']:.1f}%", peak=f"{s['peak_mb']:.0f}",
              util="" if util is None else f"{util:.0f}%",
              notes="; ".join(x for x in (notes, rounds[0].get("notes", "")) if x))
    return rate


def headline(check: Check) -> tuple[str, tuple[str, int]]:
    """(the fast path, (precision, batch)) of the headline rows: `graphs` at bf16-mixed and
    the base batch on a GPU, `compile` at fp32 and batch 4 on the CPU."""
    if check.cpu:
        return "compile", ("32-true", 4)
    return "graphs", ("bf16-mixed", check.base["batch_size"])


def clip(text: str, n: int = 48) -> str:
    """`text`'s last `n` characters, "…" first where it was longer."""
    return text if len(text) <= n else "…" + text[-(n - 1):]


def stage_profile(check: Check) -> None:
    """The headline setting's eager and fast-path steps under torch.profiler: the GPU's busy
    time a step (the union of its kernels' and copies' spans) against the step's period on
    the GPU timeline, and the top host ops. Busy well below the period: the GPU waited for
    the host (launches, Python, the loop) within the step. A last row: the fast path's
    Python time by source file (cProfile, a run of its own)."""
    mode, (precision, batch) = headline(check)
    for path in ("off", mode):
        config = f"cached, {precision}, batch {batch}, fast_path {path}, profiled"
        spec = check.train_spec(precision, batch, fast_path=path, profile=True,
                                sample_gpu=False, steps=PROFILE_STEPS,
                                warmup=max(check.base["warmup"], PROFILE_WARMUP))
        res = attempt(check, "profile", config, lambda spec=spec: check.run(spec))
        if not res:
            continue
        period = summarize_train([res])["step_ms"]
        busy = res.get("device_busy_ms")
        top = ", ".join(f"{r['op'][:40]} {r['self_cpu_ms']:.1f}" for r in res["profile"][:5])
        if any("dynamo_timed" in r["op"] for r in res["profile"]):  # its timer's own label
            top += " (a compile ran in the profiled steps: its ops lead)"
        check.add("profile", config, f"{busy:.1f} ms GPU busy of {period:.1f} ms a step"
                  if busy is not None else f"{period:.1f} ms a step", step_ms=f"{period:.0f}",
                  notes=f"{PROFILE_STEPS} steps; top host ops, self ms a step: {top}; "
                        "the profiler slows the host")
    # Then the fast path's host time by source file (cProfile): the CUDA-graph trees' own
    # bookkeeping, AOTAutograd's, Lightning's loop, the optimiser, this package
    config = f"cached, {precision}, batch {batch}, fast_path {mode}, Python profiled"
    spec = check.train_spec(precision, batch, fast_path=mode, python_profile=True,
                            sample_gpu=False, steps=PROFILE_STEPS,
                            warmup=max(check.base["warmup"], PROFILE_WARMUP))
    res = attempt(check, "profile", config, lambda: check.run(spec))
    if res:
        period = summarize_train([res])["step_ms"]
        files = res["python_by_file"]
        top = ", ".join(f"{clip(r['where'])} {r['self_ms']:.2f}" for r in files[:6])
        check.add("profile", config, f"{sum(r['self_ms'] for r in files):.1f} ms in the top "
                  f"{len(files)} files of {period:.1f} ms a step", step_ms=f"{period:.0f}",
                  notes=f"{PROFILE_STEPS} steps; Python self ms a step by file: {top}; "
                        "backward on the training thread; cProfile slows the host",
                  python_by_file=files)  # all of them, in the JSON


def stage_train(check: Check) -> None:
    """Eager rows (`fast_path: off`) at both precisions and batches, then the fast path's rows
    (`graphs`; `compile` on the CPU) beside them, with their speed-up over eager. The
    headline pair, bf16-mixed at the base batch, runs `check.rounds` times, eager and fast
    path alternating, each round a fresh process: its rows pool every round's steps."""
    mode, head = headline(check)
    fast_rows = [("32-true", 4)] if check.cpu else [("bf16-mixed", 64), ("bf16-mixed", 128),
                                                    ("32-true", 64)]

    def fast_spec(precision: str, batch: int) -> dict[str, Any]:
        return check.train_spec(precision, batch, fast_path=mode,
                                warmup=max(check.base["warmup"], 4))

    ondevice = f"{mode}, grids on the device"
    pair: dict[str, list[dict[str, Any]]] = {"off": [], mode: [], ondevice: []}
    for _ in range(check.rounds):  # a failed round leaves the others' steps to pool
        for path, spec in (("off", check.train_spec(*head, fast_path="off")),
                           (mode, fast_spec(*head)),
                           (ondevice, {**fast_spec(*head), "features_on_device": True})):
            config = f"cached, {head[0]}, batch {head[1]}, fast_path {path}"
            res = attempt(check, "train", config, lambda spec=spec: check.run(spec))
            if res:
                pair[path].append(res)
                check.keep_round(config, res)
    for precision in ("bf16-mixed", "32-true"):
        for batch in ((4, 8) if check.cpu else (64, 128)):
            if (check.fast_only or check.headline_only) and (precision, batch) != head:
                continue
            config = f"cached, {precision}, batch {batch}"
            spec = check.train_spec(precision, batch, fast_path="off")
            res = pair["off"] if (precision, batch) == head else \
                attempt(check, "train", config, lambda spec=spec: check.run(spec))
            if res:  # else its FAILED row is in the table
                check.single[(precision, batch)] = train_row(check, "train", config, res)
    fast: dict[tuple[str, int], float] = {}
    for precision, batch in fast_rows:
        if check.headline_only and (precision, batch) != head:
            continue
        config = f"cached, {precision}, batch {batch}, fast_path {mode}"
        spec = fast_spec(precision, batch)
        res = pair[mode] if (precision, batch) == head else \
            attempt(check, "train", config, lambda spec=spec: check.run(spec))
        if not res:
            continue
        rate = fast[(precision, batch)] = train_row(check, "train", config, res)
        eager = check.single.get((precision, batch))
        if eager:
            check.note(f"{rate / eager:.2f}x eager")
    if pair[ondevice]:  # the fast path, its batches gathered on the device
        rate = train_row(check, "train", f"cached, {head[0]}, batch {head[1]}, fast_path "
                         f"{ondevice}", pair[ondevice])
        loader, eager = fast.get(head), check.single.get(head)
        check.note("; ".join(([f"{rate / loader:.2f}x the loader's grids"] if loader else [])
                             + ([f"{rate / eager:.2f}x eager"] if eager else [])
                             + ["the peak holds the grids"]))


def attempt(check: Check, stage: str, config: str, fn: Callable[[], Any]) -> Any:
    """`fn()`, or None after a FAILED row (and exit status 1): one broken stage or row (out of
    memory, say) must not hide the others' figures. Past the deadline, a skipped row."""
    if check.left() <= 0:
        check.add(stage, config, "skipped", notes="past --deadline-s")
        return None
    try:
        return fn()
    except PastDeadline as e:  # not a failure: the check ran out of its time
        check.add(stage, config, str(e), notes="past --deadline-s")
        return None
    except Exception as e:
        log.exception("%s %s failed", stage, config)
        check.failed = True
        check.add(stage, config, "FAILED", notes=f"{type(e).__name__}: {str(e)[:200]}")
        return None


def stage_uncached(check: Check) -> None:
    split_file, image_root, size = jpeg_set(check)
    spec = check.train_spec("bf16-mixed", check.base["batch_size"], cached=False,
                            fast_path=check.fast_path, warmup=max(check.base["warmup"], 4),
                            num_workers=check.loader_workers, split_file=split_file,
                            image_root=image_root)
    train_row(check, "train uncached", f"JPEG, bf16-mixed, batch {spec['batch_size']}, "
              f"fast_path {check.fast_path}",
              check.run(spec), notes=f"{check.loader_workers} loader workers decoding "
                                     f"{size} JPEGs; the CNN runs on every batch")


def stage_coco(check: Check, prepared: tuple[dict[str, Any], str] | None = None) -> None:
    """The COCO-size row; `prepared`: the cache already synthesised (`synthesize_coco_cache`)."""
    spec, notes = prepared or synthesize_coco_cache(check)
    cache_dir = Path(spec["cache_dir"])
    before = len(list(cache_dir.glob("*.npy")))
    res = check.run(spec)
    if len(list(cache_dir.glob("*.npy"))) > before + 1:  # train found, only val built
        notes += "; WARNING: the run did not find the synthetic train cache"
    config = f"cached, bf16-mixed, batch {spec['batch_size']}, fast_path {check.fast_path}"
    loader = train_row(check, "train COCO-size", config, res, notes=notes)
    for array in cache_dir.glob("*.npy"):  # the next row starts from the disk too
        _drop_from_page_cache(array)
    res = attempt(check, "train COCO-size", f"{config}, grids on the device",
                  lambda: check.run({**spec, "features_on_device": True}))
    if res:  # else its FAILED row (too little GPU memory, say) is in the table
        rate = train_row(check, "train COCO-size", f"{config}, grids on the device", res,
                         notes="the split's grids copied to the device at the start; the "
                               "peak holds them")
        check.note(f"{rate / loader:.2f}x the loader's")


def stage_beam(check: Check) -> None:
    """Every beam size and batch in one worker process (one model, one cache). Each row is
    kept as the worker measures it: a worker killed at the deadline, or one that dies, leaves
    the rows it finished."""
    images = 20 if check.cpu else 1000
    settings = [[beam, batch, fast] for fast in FAST_BEAMS for beam in (3, 5)  # off's rows first:
                for batch in ((5, 10) if check.cpu else (100, 500))]  # kept if graphs fail
    rows_file = check.work / "beam_rows.jsonl"
    rows_file.unlink(missing_ok=True)
    spec = {**check.base, "kind": "beam", "attention": "soft", "num_workers": 0,
            "precision": "bf16-mixed", "max_len": 20, "beam_images": images,
            "settings": settings, "rows_file": str(rows_file)}
    stopped: Exception | None = None  # a worker killed at the deadline, or one that died
    try:
        rows = check.run(spec)["rows"]
    except Exception as e:  # its finished rows stand; the rest is one row
        rows, stopped = finished_rows(rows_file), e
    eager: dict[tuple[int, int], float] = {}
    for (beam, batch, fast), res in zip(settings, rows):
        config = f"beam {beam}, {batch} images per batch, fast_beam {fast}"
        if "error" in res:  # this setting failed; the worker went on with the next
            check.failed = True
            check.add("beam search", config, "FAILED", notes=res["error"])
            continue
        rate = res["captions_per_s"]
        if fast == "off":
            eager[(beam, batch)] = rate
        versus = f"; {rate / eager[(beam, batch)]:.2f}x off's" if fast != "off" and \
            (beam, batch) in eager else ""
        check.add("beam search", config, f"{rate:.1f} captions/s",
                  step_ms=f"{res['step_ms']:.0f}", peak=f"{res['peak_mb']:.0f}",
                  notes=res["notes"] + versus)
    if stopped is None:
        return
    rest = f"the other {len(settings) - len(rows)} settings" if len(rows) < len(settings) \
        else "the worker, after its last setting"  # a fault at teardown: a graph's, say
    if isinstance(stopped, PastDeadline):
        check.add("beam search", rest, str(stopped), notes="past --deadline-s")
    else:
        check.failed = True
        check.add("beam search", rest, "FAILED",
                  notes=f"{type(stopped).__name__}: {str(stopped)[:200]}")


def finished_rows(path: Path) -> list[dict[str, Any]]:
    """The rows a worker appended to `path` (JSON lines) before it was killed; a line cut
    short by the kill is not one."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def stage_overlay(check: Check) -> None:
    device = torch.device("cpu" if check.cpu else "cuda")
    sizes = dict(captions=8, words=6, size=64, grid=4) if check.cpu else \
        dict(captions=64, words=16, size=224, grid=14)
    per_s, ms, _ = benchmark_overlays.bench(device, upsample="bicubic", hard=False, warmup=2,
                                            repeats=5, **sizes)
    check.add("overlays", f"render_strips on {device.type}", f"{per_s:.1f} strips/s",
              step_ms=f"{ms:.0f}", notes=f"{sizes['captions']} captions x {sizes['words']} "
              f"words, {sizes['size']} px, {sizes['grid']}x{sizes['grid']} grid, bicubic")


def ddp_spec(check: Check) -> dict[str, Any] | None:
    """The DDP row's spec (all GPUs; 2 processes with --cpu), or None with fewer than 2 GPUs."""
    n = 2 if check.cpu else torch.cuda.device_count()
    if n < 2:
        return None
    batch = check.base["batch_size"]
    return check.train_spec("bf16-mixed", batch, devices=n,
                            cache_dir=str(check.work / "features_ddp"))


def stage_ddp(check: Check, res: dict[str, Any] | None) -> None:
    """The DDP row from its worker's result (None: fewer than 2 GPUs)."""
    if res is None:
        check.add("ddp", "all GPUs, bf16-mixed", "skipped", notes="fewer than 2 GPUs")
        return
    n, batch = res["world_size"], check.base["batch_size"]
    config = f"{n} {'processes' if check.cpu else 'GPUs'}, bf16-mixed, batch {batch} each"
    rate = train_row(check, "ddp", config, res, world=n)  # kept before anything else runs
    single = check.single.get(("bf16-mixed", batch))
    if single is None:
        one = attempt(check, "ddp", f"{config}: the one-device run",
                      lambda: check.run(check.train_spec("bf16-mixed", batch)))
        single = summarize_train([one])["captions_per_s"] if one else None
    if single:
        row = next(r for r in reversed(check.rows) if r["config"] == config)
        row["notes"] = (f"scaling efficiency {100 * rate / (n * single):.0f}% "
                        f"(1 device: {single:.1f} pairs/s); " + row["notes"])
        check.save()


# ---------------------------------------------------------------------------------------------
# Data


def jpeg_set(check: Check) -> tuple[str, str, str]:
    """The shapes train and val images as JPEGs (640x480, quality 90; 96x72 with --cpu) and a
    COCO-like Karpathy file over them: (split file, image folder, size)."""
    from PIL import Image

    w, h = (96, 72) if check.cpu else (640, 480)
    folder = check.work / "jpeg"
    folder.mkdir(exist_ok=True)
    names: dict[str, list[str]] = {"train": [], "val": []}
    for split, found in names.items():
        for png in sorted((Path(check.base["root"]) / "images").glob(f"{split}_*.png")):
            name = png.with_suffix(".jpg").name
            if not (folder / name).exists():
                with Image.open(png) as im:
                    im.convert("RGB").resize((w, h), Image.BICUBIC).save(folder / name,
                                                                          quality=90)
            found.append(name)
    split = make_coco_karpathy(
        check.work / "jpeg_captions.json", filenames=names, captions=0,
        splits={"train": 64 if check.cpu else 20_000, "val": len(names["val"])})
    return str(split), str(folder), f"{w}x{h}"


class RandomGrids(torch.nn.Module):
    """Stands in for the frozen CNN when synthesising a cache: random post-ReLU (B, L, D)
    grids, whatever the images."""

    def __init__(self, locations: int, dim: int) -> None:
        super().__init__()
        self.locations, self.dim = locations, dim
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the cache build asks its device

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.randn(images.size(0), self.locations, self.dim).relu_()


def grid_of(base: dict[str, Any]) -> tuple[int, int]:
    """(L, D) of the check's annotation grids."""
    from captioning.models.encoder import BACKBONES

    if base["paper"]:
        return 14 * 14, BACKBONES["vgg19"].dim
    return base["grid_size"] ** 2, BACKBONES[base["encoder"]].dim


def coco_count(check: Check, row_bytes: int) -> tuple[int, str]:
    """How many grids to synthesise: COCO's train split, or what 80% of the free disk holds."""
    want = check.coco_images
    free = shutil.disk_usage(check.work).free
    n = min(want, int(0.8 * free) // row_bytes)
    why = f"{n:,} of {want:,} grids" + (" (all the free disk holds)" if n < want else "")
    return n, f"{why}, {n * row_bytes / 1e9:.1f} GB"


def linked_images(folder: Path, n: int) -> list[str]:
    """`n` image files (hard links of one small JPEG, copies where links fail)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    seed = folder / "seed.jpg"
    Image.new("RGB", (32, 32), (120, 90, 60)).save(seed)
    names = [f"img_{i:06d}.jpg" for i in range(n)]
    for name in names:
        target = folder / name
        if not target.exists():
            try:
                os.link(seed, target)
            except OSError:
                shutil.copyfile(seed, target)
    return names


def synthesize_coco_cache(check: Check) -> tuple[dict[str, Any], str]:
    """Write the COCO-size train cache through `FeatureCache.build` (random grids for the CNN)
    and return the training row's spec and notes. The grids' key is the one the row's model
    computes (same seed, same encoder weights), so the row finds them."""
    import lightning.pytorch as L

    folder, n_val = check.work / "coco_size", 8 if check.cpu else 64
    spec = check.train_spec("bf16-mixed", check.base["batch_size"], cache_verify="size",
                            fast_path=check.fast_path, warmup=max(check.base["warmup"], 4),
                            cache_dir=str(folder / "features"),
                            num_workers=check.loader_workers)
    locations, dim = grid_of(check.base)
    n, notes = coco_count(check, locations * dim * 2)
    t0 = time.perf_counter()
    names = linked_images(folder / "images", n + n_val)
    split = make_coco_karpathy(folder / "captions.json", filenames=names, captions=0,
                                         splits={"train": n, "val": n_val})
    spec.update(split_file=str(split), image_root=str(folder / "images"))
    L.seed_everything(0, verbose=False)
    module, dm = build_run(spec, cached=True)
    dm.use_encoder_cache(RandomGrids(locations, dim), module.captioner.feature_cache_key(),
                         device="cpu")
    cache = dm.cache_features(["train"])["train"]
    _drop_from_page_cache(cache.array_path)
    notes += f"; synthesised in {time.perf_counter() - t0:.0f} s, dropped from the page cache"
    return spec, notes


def _drop_from_page_cache(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError) as e:
        log.warning("could not drop %s from the page cache: %s", path, e)


# ---------------------------------------------------------------------------------------------
# GPU tests


def gpu_test_files() -> list[str]:
    """The test modules that hold GPU tests: pytest collects only these, so a module that
    needs what a bare GPU machine lacks (pycocoevalcap, say) cannot stop the GPU tests."""
    marked = re.compile(r"^(@pytest\.mark\.gpu\b|pytestmark\b.*\bpytest\.mark\.gpu\b)", re.M)
    return [str(p) for p in sorted((ROOT / "tests").glob("test_*.py"))
            if marked.search(p.read_text())]


SLOWEST_TESTS = 3  # named in the GPU tests' row: where a short lease's minutes go


def gpu_test_command(files: list[str]) -> list[str]:
    """`pytest -m gpu` over `files`, with every phase (setup, call, teardown) of 1 s or more
    timed, so that `slowest_tests` can add up each test's."""
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
            "--durations=0", "--durations-min=1", *files]


def start_gpu_tests() -> subprocess.Popen[str]:
    return subprocess.Popen(gpu_test_command(gpu_test_files()), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **own_process_group())


def finish_gpu_tests(check: Check, proc: subprocess.Popen[str], *,
                     timeout: float | None = None) -> None:
    """The GPU tests' row; killed (with their process group) after `timeout` seconds (default:
    at the deadline), reporting what had passed by then."""
    killed = False
    try:
        out, _ = proc.communicate(timeout=max(1.0, check.left() if timeout is None else timeout))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, killed = proc.communicate()[0], True
    if killed:
        passed = sum(line.count(".") for line in out.splitlines()  # pytest -q's progress
                     if re.fullmatch(r"[.sxXFE]+\s*(\[\s*\d+%\])?", line.strip()))
        check.add("gpu tests", "pytest -m gpu", "killed at --deadline-s",
                  notes=f"about {passed} passed before; the output's tail is in the log")
        log.error("pytest -m gpu killed at the deadline:\n%s", out[-4000:])
        return
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    summary = next((line for line in reversed(out.splitlines())  # what came after it aside
                    if re.search(r"\b\d+ (passed|failed|skipped|errors?|deselected)\b.* in "
                                 r"[\d.]+s", line)), "")
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary):
        counts[what.rstrip("s") if what.startswith("error") else what] += int(n)
    bad = counts["failed"] + counts["error"]
    # With CUDA, no test that ran is a failure too (all skipped, none collected: exit 5).
    if bad or proc.returncode not in (0, 5) or not summary or (not check.cpu and (
            counts["passed"] == 0 or proc.returncode == 5)):
        check.failed = True
        log.error("pytest -m gpu:\n%s", out[-4000:])
    slow = ", ".join(f"{name} {s:.0f} s" for s, name in slowest_tests(out)[:SLOWEST_TESTS])
    check.add("gpu tests", "pytest -m gpu", f"{counts['passed']} passed, {bad} failed",
              notes=f"{counts['skipped']} skipped" + (" (no CUDA)" if check.cpu else "")
              + (f"; slowest: {slow}" if slow else ""))


def slowest_tests(out: str) -> list[tuple[float, str]]:
    """pytest's `--durations` lines ("12.34s call  tests/test_gpu.py::test_x[a]"): seconds
    and test name (its phases of 1 s or more added up), slowest first."""
    took: dict[str, float] = {}
    for s, name in re.findall(r"^([\d.]+)s (?:setup|call|teardown)\s+\S+::(\S+)$", out, re.M):
        took[name] = took.get(name, 0.0) + float(s)
    return sorted(((s, name) for name, s in took.items()), reverse=True)


# ---------------------------------------------------------------------------------------------
# Orchestration


def prepare(args: argparse.Namespace, work: Path, start: float) -> Check:
    """The check's shapes data and base spec: the paper configuration on a GPU, tiny sizes
    with --cpu; `start`: the run's start (time.monotonic), for --deadline-s."""
    if args.cpu:
        base = make_base(work, encoder="resnet18", grid_size=4, tiny=True,
                                   batch_size=4, num_train=16, num_val=8, image_size=64,
                                   steps=2, warmup=1, threads=args.threads or 1)
    else:
        base = make_base(work, device="cuda", paper=True, batch_size=64,
                                   num_train=640, num_val=64, image_size=224,
                                   steps=args.steps, warmup=args.warmup, threads=args.threads)
    return Check(cpu=args.cpu, work=work, base=base, threads=base["threads"],
                 fast_only=args.fast_only, headline_only=args.headline_only,
                 rounds=args.rounds or (1 if args.cpu else 2),
                 deadline=None if args.deadline_s is None else start + args.deadline_s,
                 header={"machine": describe_machine(base["device"], base["threads"]),
                         "steps": base["steps"], "warmup": base["warmup"]},
                 json_path=Path(args.json) if args.json else None,
                 coco_images=args.coco_images or (256 if args.cpu else COCO_TRAIN_IMAGES))


def run_stage(check: Check, name: str, fn: Callable[[], None]) -> bool:
    """Run a stage; a failure becomes its row (and exit status 1), and the next stage runs.
    Returns whether it ran through."""
    log.info("stage: %s", name)
    t0 = time.perf_counter()
    try:
        return attempt(check, name, "", lambda: fn() or True) is not None
    finally:
        check.seconds[name] = time.perf_counter() - t0
        log.info("stage %s: %.0f s", name, check.seconds[name])
        check.save()


def run_checks(args: argparse.Namespace, check: Check) -> None:
    """Every stage asked for, the timed ones one after another. On a GPU the tests run first,
    while the COCO-size cache is written (neither is timed); with --cpu the tests and the DDP
    run go on in subprocesses while the other stages run here."""
    stages = args.stages.split(",")
    tests = start_gpu_tests() if "tests" in stages else None
    prepared: dict[str, Any] = {}
    steps: dict[str, Callable[[Check], None]] = {
        "train": stage_train, "coco": stage_coco, "profile": stage_profile,
        "uncached": stage_uncached,
        "beam": stage_beam, "overlay": stage_overlay}
    if "coco" in stages and not check.cpu:
        if run_stage(check, "coco cache", lambda: prepared.update(
                coco=synthesize_coco_cache(check))):
            steps["coco"] = lambda c: stage_coco(c, prepared["coco"])
        else:
            stages.remove("coco")
    if tests is not None and not check.cpu:
        t0 = time.perf_counter()
        finish_gpu_tests(check, tests, timeout=None if check.deadline is None else
                         TESTS_SHARE * max(0.0, check.left()))  # the timed stages' time kept
        check.seconds["tests"] = time.perf_counter() - t0  # after the cache: the rest of them
    spec = ddp_spec(check) if "ddp" in stages else None
    ddp = start_worker(spec, check.threads) if spec and check.cpu else None
    for name in stages:  # in the order asked for: what matters most first, past a deadline
        if name in steps:
            run_stage(check, name, lambda f=steps[name]: f(check))
    if "ddp" in stages:
        def ddp_row() -> None:
            res = finish_worker(ddp, "train", timeout=max(1.0, check.left())) \
                if ddp is not None else (check.run(spec) if spec else None)
            stage_ddp(check, res)
        run_stage(check, "ddp", ddp_row)
        if ddp is not None and ddp.poll() is None:  # its stage skipped: it must not run on
            with contextlib.suppress(ProcessLookupError):
                os.killpg(ddp.pid, signal.SIGKILL)
            ddp.communicate()
    if tests is not None and check.cpu:
        finish_gpu_tests(check, tests)


def print_table(check: Check) -> None:
    mode = ("CPU fallback: tiny sizes (resnet18 at 64 px, 4x4 grid, 32-unit decoder); the "
            "figures only show that every stage runs") if check.cpu else (
        "paper configuration: VGG-19 14x14x512 (random weights, frozen), embed/attn 512, "
        f"LSTM 1800; {check.base['steps']} timed steps per training row after "
        f"{check.base['warmup']} warm-up steps; medians")
    print(f"\nmachine: {describe_machine(check.base['device'], check.threads)}")
    print(f"gpu-check, {mode}")
    cols = [("stage", "stage"), ("configuration", "config"), ("result", "result"),
            ("step ms", "step_ms"), ("data wait", "wait"), ("peak MB", "peak"),
            ("GPU util", "util"), ("notes", "notes")]
    width = {k: max(len(h), *(len(str(r.get(k, ""))) for r in check.rows)) for h, k in cols}
    print("| " + " | ".join(h.ljust(width[k]) for h, k in cols) + " |")
    print("|" + "|".join("-" * (width[k] + 2) for _, k in cols) + "|")
    for r in check.rows:
        print("| " + " | ".join(str(r.get(k, "")).ljust(width[k]) for _, k in cols) + " |")
    print("seconds per stage: " + ", ".join(f"{k} {v:.0f}" for k, v in check.seconds.items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true",
                   help="every stage at tiny sizes on the CPU (automatic without CUDA)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma-separated subset of: {','.join(STAGES)}")
    p.add_argument("--steps", type=int, default=40, help="timed steps per training row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of the headline pair, eager and fast path alternating at "
                        "bf16-mixed and the base batch (default 2; 1 with --cpu)")
    p.add_argument("--coco-images", type=int, default=None,
                   help=f"grids of the COCO-size cache (default {COCO_TRAIN_IMAGES:,}; 256 "
                        "with --cpu), fewer when the disk is short")
    p.add_argument("--fast-only", action="store_true",
                   help="train stage: only eager bf16-mixed at the base batch, then the fast "
                        "path's rows")
    p.add_argument("--headline-only", action="store_true",
                   help="train stage: only the headline rows (bf16-mixed at the base batch: "
                        "eager, fast path, fast path with the grids on the device)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="no row or stage starts after this many seconds (a running worker is "
                        "killed then); the rows not run are listed as skipped")
    p.add_argument("--threads", type=int, default=None, help="intra-op CPU threads")
    p.add_argument("--workdir", default=None, help="keep files here (default: a temp dir)")
    p.add_argument("--json", default=None,
                   help="also write the rows as JSON here (after every row)")
    args = p.parse_args(argv)
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.cpu and not torch.cuda.is_available():
        log.info("no CUDA device: running the CPU fallback (tiny sizes)")
        args.cpu = True
    if args.cpu:
        torch.set_num_threads(args.threads or 1)
    with tempfile.TemporaryDirectory(prefix="captioning-gpu-check-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        check = prepare(args, work, start)
        from captioning.locks import sigterm_raises

        try:  # SIGTERM from outside: workers killed with their groups, the rows kept
            with sigterm_raises():
                run_checks(args, check)
        finally:
            print_table(check)
            check.save()
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
