"""The package as a user meets it: shipped configs found by name, `captioning configs` and
`--help`, the one-line error for missing pretrained weights, and console output where every
line is printed once, without warnings about the project's own wiring."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_java, shapes_cli_args
from tiny_runs import REPO, user_env

from captioning.cli import main
from captioning.commands.configs import (
    CONFIG_DIR,
    UnknownConfigError,
    find_config,
    resolve_config_args,
    shipped_configs,
)


def test_configs_are_package_data_with_one_copy() -> None:
    assert CONFIG_DIR.is_relative_to(REPO / "captioning")
    link = REPO / "configs"
    assert link.is_symlink() and link.resolve() == CONFIG_DIR.resolve()
    on_disk = {p.relative_to(CONFIG_DIR).with_suffix("").as_posix()
               for p in CONFIG_DIR.rglob("*.yaml")}
    assert set(shipped_configs()) == on_disk
    assert {"trainer/cpu", "data/shapes", "model/demo_soft", "model/paper_soft"} <= on_disk
    text = (REPO / "pyproject.toml").read_text()
    assert '"configs/*/*.yaml"' in text  # what the wheel ships
    assert '"models/native/*.cpp"' in text  # the native kernel's source, compiled on first use
    from captioning.models.native import SOURCES  # the kernels' sources, shipped alike

    native_dir = REPO / "captioning" / "models" / "native"
    assert {f.name for f in SOURCES} == {"attention.cpp", "cell.cpp", "dropout.cpp",
                                         "layout.cpp"}
    assert set(SOURCES) == set(native_dir.glob("*.cpp"))  # every source built, and shipped
    assert all(f.is_file() and f.parent == native_dir for f in SOURCES)


@pytest.mark.parametrize("name", ["paper_soft", "model/paper_soft", "model/paper_soft.yaml",
                                  "configs/model/paper_soft.yaml"])
def test_a_config_by_name(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ folder here: only the shipped copy is found
    assert find_config(name) == CONFIG_DIR / "model" / "paper_soft.yaml"


def test_a_path_wins_over_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu.yaml").write_text("trainer: {max_epochs: 1}\n")
    assert find_config("cpu.yaml") == Path("cpu.yaml")
    assert find_config("cpu") == CONFIG_DIR / "trainer" / "cpu.yaml"
    (tmp_path / "data" / "shapes").mkdir(parents=True)  # the generated dataset, not a config
    assert find_config("data/shapes") == CONFIG_DIR / "data" / "shapes.yaml"


def test_group_flags_and_unknown_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = resolve_config_args(["fit", "--config", "cpu", "--model=demo_soft",
                                "--data", "shapes", "--model.decode.beam_size", "3",
                                "--data", "{batch_size: 4}"])
    assert args == ["fit", "--config", str(CONFIG_DIR / "trainer" / "cpu.yaml"),
                    f"--model={CONFIG_DIR / 'model' / 'demo_soft.yaml'}",
                    "--data", str(CONFIG_DIR / "data" / "shapes.yaml"),
                    "--model.decode.beam_size", "3", "--data", "{batch_size: 4}"]
    with pytest.raises(UnknownConfigError, match="captioning configs"):
        find_config("paper_sfot")


def test_unknown_config_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", "nonexistent_config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: nonexistent_config: no such file, and no shipped config of that name "
                   "(`captioning configs` lists them)"]


def test_fit_takes_shipped_configs_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "trainer/cpu", "--config", "shapes", "--config", "paper_hard",
              "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["net"]["attention"] == "hard"
    assert cfg["model"]["net"]["backbone"] == "vgg19"
    assert cfg["data"]["source"]["class_path"].endswith("ShapesSource")


def test_configs_command_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    for name in shipped_configs():
        assert name in out
    assert "Xu et al. 2015 soft attention" in out  # each config's first comment line
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("fit", "demo", "caption", "predict", "export", "configs"):
        assert f"  {command}" in out


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "captioning.cli", *args], cwd=cwd,
                          env=user_env(**env), capture_output=True, text=True, timeout=600)


def test_missing_pretrained_weights_offline_is_one_line(shapes_root: Path,
                                                        tmp_path: Path) -> None:
    """An empty $TORCH_HOME and downloads that fail (a proxy nobody listens on)."""
    home = tmp_path / "torch-home"
    home.mkdir()
    proxy = "http://127.0.0.1:9"
    out = _run(["fit", "--config", "trainer/cpu", "--config", "data/shapes",
                "--config", "model/demo_soft", *shapes_cli_args(shapes_root),
                "--trainer.logger", "false", "--trainer.max_epochs", "1"], tmp_path,
               TORCH_HOME=str(home), https_proxy=proxy, HTTPS_PROXY=proxy, http_proxy=proxy,
               HTTP_PROXY=proxy, WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    expected = (f"error: backbone mobilenet_v2_s16: pretrained weights "
                f"MobileNet_V2_Weights.IMAGENET1K_V1 are not in {home / 'hub' / 'checkpoints'} "
                "and cannot be downloaded")
    assert len(errors) == 1 and errors[0].startswith(expected), out.stderr[-2000:]
    assert "put mobilenet_v2-b0353104.pth there" in errors[0]
    assert "model.net.weights: /path/to/file.pth" in errors[0]
    assert not list((home / "hub" / "checkpoints").glob("*.pth*")), "no partial download left"


@pytest.mark.parametrize(("target", "command"), [
    ("demo", "captioning demo"), ("demo-hard", "captioning demo --attention hard"),
    ("demo-scst", "captioning demo --scst")])
def test_make_demo_targets_run_the_demos_the_tests_run(target: str, command: str) -> None:
    """`make demo`, `make demo-hard` and `make demo-scst` are the commands the demo tests run
    (here and in test_scst.py), offline."""
    out = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # also under `make test`
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if "captioning demo" in ln]
    assert line.startswith("WANDB_MODE=offline ") and line.endswith(f"/bin/{command}"), line


@needs_java
@pytest.mark.parametrize("attention,extra", [
    ("soft", []), ("hard", []), ("soft", ["--trainer.precision", "bf16-mixed"])],
    ids=["soft", "hard", "soft-bf16-mixed"])
def test_demo_prints_each_line_once(attention: str, extra: list[str], shapes_root: Path,
                                    tmp_path: Path) -> None:
    """The demo's console output (`make demo`, `make demo-hard`: `--attention hard`, and the
    README's CPU bf16 run: `--trainer.precision bf16-mixed`): no line twice, none of the
    library messages about wiring."""
    run = tmp_path / "run"
    out = _run(["demo", "--attention", attention, *extra, "--run-dir", str(run), "--samples", "2",
                *shapes_cli_args(shapes_root), "--data.cache_dir", str(tmp_path / "features"),
                "--model.net.weights", "null", "--model.decode.max_len", "6",
                "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
                "--trainer.enable_progress_bar", "false"], tmp_path,
               WANDB_MODE="offline", PYTHONPATH=str(REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in (out.stdout + out.stderr).splitlines()
             if ln.strip() and not ln.startswith(("wandb:", "  ", "─", "│"))]
    repeated = {ln: n for ln, n in collections.Counter(lines).items() if n > 1}
    assert not repeated, repeated
    text = out.stdout + out.stderr
    for message in ("args parameter is intended", "litlogger", "anonymous setting",
                    "in eval mode at the start of training", "Traceback"):
        assert message not in text, message
    assert "INFO: Seed set to 0" in text  # Lightning's lines still show, once
    assert "Shapes test split" in out.stdout
    assert ("bfloat16 Automatic Mixed Precision" in text) == bool(extra)
    if extra:  # the command the README shows
        assert "`captioning demo --trainer.precision bf16-mixed`" in (REPO / "README.md").read_text()
    ckpt = torch.load(next(run.rglob("last.ckpt")), weights_only=True)
    assert ckpt["captioning_model_config"]["attention"] == attention
