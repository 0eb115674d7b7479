"""W&B without a login or a network: the run goes offline with one line instead of crashing
(no API key) or hanging (a key but no reachable server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_runs import REPO, cli_config

SCRIPT = """
import sys
import wandb
init = wandb.init
def init_spy(*args, **kwargs):  # which init_timeout W&B is given, call by call
    print("init_timeout", getattr(kwargs.get("settings"), "init_timeout", None), flush=True)
    return init(*args, **kwargs)
wandb.init = init_spy
from captioning.callbacks import WandbLogger
logger = WandbLogger(project="t", save_dir=sys.argv[1], init_timeout=float(sys.argv[2]))
logger.log_metrics({"x": 1.0}, step=0)
wandb.finish()
print("OFFLINE" if logger.experiment.settings.mode in ("offline", "dryrun") else "ONLINE")
"""


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    return {**env, "HOME": str(home), "WANDB_CONFIG_DIR": str(home / "wandb-config"),
            "PYTHONPATH": str(REPO), **extra}


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if "logging to W&B offline" in ln]


def test_no_api_key_goes_offline_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run"), "30"],
                         env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OFFLINE" in out.stdout.splitlines()
    (line,) = _warnings(out.stderr)
    assert "no W&B API key" in line and f"wandb sync {tmp_path / 'run'}" in line
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_unreachable_server_times_out_then_goes_offline(tmp_path: Path) -> None:
    env = _env(tmp_path, WANDB_API_KEY="a" * 40, WANDB_BASE_URL="http://127.0.0.1:9")
    # timeout: a hang guard only (W&B alone retried for minutes)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run"), "5"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    lines = out.stdout.splitlines()
    assert "OFFLINE" in lines
    # the online attempt with our 5 s timeout, then the offline run (W&B's own settings)
    assert [ln for ln in lines if ln.startswith("init_timeout")] == \
        ["init_timeout 5.0", "init_timeout None"]
    (line,) = _warnings(out.stderr)
    assert "W&B server unreachable" in line
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_fit_with_an_online_logger_and_no_login(shapes_dm_kwargs: dict, cache_dir: Path,
                                                tmp_path: Path) -> None:
    """`captioning fit` with the configs' W&B logger set online, on a machine never logged in."""
    cfg = cli_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    logger = ("[{class_path: captioning.callbacks.WandbLogger, "
              f"init_args: {{project: t, save_dir: {tmp_path / 'run'}}}}}]")
    out = subprocess.run([sys.executable, "-m", "captioning.cli", "fit", "--config", str(cfg),
                          "--trainer.logger", logger], cwd=tmp_path, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_warnings(out.stderr)) == 1
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_bad_init_timeout() -> None:
    from captioning.callbacks import WandbLogger

    with pytest.raises(ValueError, match="init_timeout"):
        WandbLogger(project="t", offline=True, init_timeout=0)
