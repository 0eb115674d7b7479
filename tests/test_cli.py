"""The command line (captioning.cli.main, captioning/commands/errors.py and
commands/lightning.py): user errors become one `error:` line and a non-zero status, bugs keep
their traceback; checkpoints load with `weights_only=True` and an unsafe pickle is refused
without running; decoding settings given by the user override the checkpoint's; SIGTERM /
Ctrl-C name the saved checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from tiny_runs import (
    BATCHES,
    cli_config,
    error_lines,
)

from captioning.cli import main
from captioning.commands.errors import parser_error_line

pytestmark = pytest.mark.usefixtures("signal_handlers_restored")


class _Evil:
    """Unpickling this runs code: it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _evil_checkpoint(fitted: Path, folder: Path) -> tuple[Path, Path]:
    """A copy of a real checkpoint with a code-running object inside, and its marker file."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "pwned"
    data = torch.load(fitted, map_location="cpu", weights_only=True)
    data["hyper_parameters"]["payload"] = _Evil(marker)
    path = folder / "evil.ckpt"
    torch.save(data, path)
    return path, marker


# ------------------------------------------------------------------------------------------
# CLI (in process: captioning.cli.main)


def test_cli_sigterm_leaves_a_checkpoint_and_fit_resumes_it(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpt"
    stop = {"class_path": "tiny_runs.InterruptAt", "init_args": {"how": "SIGTERM"}}
    interrupted = cli_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir, [stop],
                          max_epochs=3)
    assert main(["fit", "--config", str(interrupted)]) == 143
    err = capsys.readouterr().err
    assert f"interrupted by SIGTERM; saved {ckpt_dir / 'last.ckpt'} (resume with " \
           "--ckpt_path last)" in err
    plain = cli_config(tmp_path / "b.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir, max_epochs=2)
    # Resumed with the CLI's default weights_only=True, through LightningCLI's own read of
    # the checkpoint's hyperparameters.
    assert main(["fit", "--config", str(plain), "--ckpt_path", "last"]) == 0
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 * BATCHES and checkpoint["epoch"] == 2


def test_cli_decoding_settings_override_the_checkpoints(shapes_dm_kwargs: dict,
                                                        cache_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from captioning import metrics

    asked: list[bool] = []
    monkeypatch.setattr(metrics, "spice_available", lambda: asked.append(True) or (False, "-"))
    ckpt_dir = tmp_path / "ckpt"
    cfg = cli_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir)
    assert main(["fit", "--config", str(cfg)]) == 0
    ckpt = ckpt_dir / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["decode"]["max_len"] == 6
    out = tmp_path / "results"
    # Lightning alone would take compute_metrics False (no decoding), max_len 6, spice False
    # and results_dir None from the checkpoint.
    assert main(["test", "--config", str(cfg), "--ckpt_path", str(ckpt),
                 "--model.decode.max_len", "2", "--model.compute_metrics", "true",
                 "--model.spice", "true", "--model.results_dir", str(out)]) == 0
    assert asked == [True]  # SPICE was asked for (and is unavailable here)
    captions = json.loads((out / "test_captions.json").read_text())
    assert captions and max(len(c["caption"].split()) for c in captions) <= 2
    assert max(len(c["caption"].split()) for c in captions) == 2  # an untrained model rambles


def test_cli_ctrl_c_exits_130_naming_the_checkpoint(shapes_dm_kwargs: dict, cache_dir: Path,
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    stop = {"class_path": "tiny_runs.InterruptAt",
            "init_args": {"how": "KeyboardInterrupt", "epoch": 0}}
    ckpt_dir = tmp_path / "ckpt"
    cfg = cli_config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir, [stop])
    assert main(["fit", "--config", str(cfg)]) == 130
    assert f"interrupted by Ctrl-C; saved {ckpt_dir / 'last.ckpt'}" in capsys.readouterr().err
    assert (ckpt_dir / "last.ckpt").is_file()


@pytest.mark.parametrize("command", ["fit", "validate", "test"])
def test_cli_loads_checkpoints_with_weights_only(
        command: str, fitted: Path, shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every read of the checkpoint given to --ckpt_path (the CLI's own check and Lightning's
    restore) is `torch.load(..., weights_only=True)`, the default the config shows."""
    with pytest.raises(SystemExit):
        main([command, "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["weights_only"] is True
    reads: list[Any] = []
    load = torch.load

    def spy(f: Any, *args: Any, **kwargs: Any) -> Any:
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None) or \
            getattr(f, "path", None)
        if name is not None and Path(name).resolve() == fitted.resolve():
            reads.append(kwargs.get("weights_only", "not given"))
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    # the fitted run's own config: fit resumes at the end of its only epoch, trains no more
    cfg = cli_config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    assert main([command, "--config", str(cfg), "--ckpt_path", str(fitted)]) == 0
    assert len(reads) >= 2 and all(w is True for w in reads), reads


def test_cli_non_finite_loss_is_one_error_line(shapes_dm_kwargs: dict, cache_dir: Path,
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    nan = {"class_path": "tiny_runs.BreakAt", "init_args": {"what": "nan", "batch": 1}}
    cfg = cli_config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt", [nan])
    assert main(["fit", "--config", str(cfg)]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert "non-finite training loss nan at global step 1" in line


@pytest.mark.parametrize("command", ["fit", "test"])
def test_cli_refuses_a_code_running_checkpoint(command: str, fitted: Path,
                                               shapes_dm_kwargs: dict, cache_dir: Path,
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    evil, marker = _evil_checkpoint(fitted, tmp_path / "evil")
    cfg = cli_config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    assert main([command, "--config", str(cfg), "--ckpt_path", str(evil)]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert f"{evil}: refused to load" in line and "exec" in line
    assert "nothing from the file was run" in line
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the control: it really runs code
    assert marker.exists()


def test_cli_subprocess_refuses_a_code_running_checkpoint(fitted: Path, shapes_dm_kwargs: dict,
                                                          cache_dir: Path,
                                                          tmp_path: Path) -> None:
    evil, marker = _evil_checkpoint(fitted, tmp_path / "evil")
    cfg = cli_config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-m", "captioning.cli", "fit", "--config", str(cfg),
                           "--ckpt_path", str(evil)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert "refused to load" in line
    assert not marker.exists()


KARPATHY = "captioning.data.sources.KarpathySplits"


def _write_bad_json(path: Path) -> Path:
    path.write_text('{"images": [\n  {"filename": "a.png",,}\n]}')
    return path


@pytest.mark.parametrize(("args", "status", "words"), [
    (["fit", "--trainer.max_epochs", "abc"], 2,
     "--trainer.max_epochs: invalid value 'abc' (expected int or null)"),
    (["fit", "--model.net.attention", "soft2"], 2,
     "--model.net.attention: invalid value 'soft2' (expected one of 'soft', 'hard')"),
    (["fit", "--no_such_option", "1"], 2, "unrecognized arguments: --no_such_option 1"),
    (["fit", "--config", "{tmp}/missing.yaml"], 2,
     "{tmp}/missing.yaml: no such file, and no shipped config of that name"),
    (["fit", "--data.batch_size", "0"], 2, "batch_size must be >= 1, got 0"),
    (["fit", "--model.decode.beam_size", "0"], 2, "decode.beam_size must be >= 1, got 0"),
    (["fit", "--model.net.attention", "hard", "--model.advantage", "nope"], 2,
     "advantage must be one of ['expected', 'sequence', 'token'], got 'nope'"),
    (["test", "--ckpt_path", "{tmp}/missing.ckpt"], 1,
     "{tmp}/missing.ckpt: checkpoint file does not exist"),
    (["fit", "--data.source", KARPATHY, "--data.source.split_file", "{tmp}/bad.json"], 1,
     "{tmp}/bad.json: line 2 column 24: field '(json)': malformed JSON"),
    (["fit", "--data.source", KARPATHY, "--data.source.split_file", "{tmp}/none.json"], 1,
     "{tmp}/none.json: (file): field '(file)': file does not exist"),
])
def test_cli_user_errors_are_one_line(args: list[str], status: int, words: str,
                                      tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _write_bad_json(tmp_path / "bad.json")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main([*args, "--trainer.logger", "false"]) == status
    err = capsys.readouterr().err
    assert "usage:" not in err
    (line,) = error_lines(err)
    assert words.replace("{tmp}", str(tmp_path)) in line


def test_config_file_mistakes_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken YAML file and an unknown key in a config file: the line names the file (and,
    for the key, the closest valid one); an unknown flag gets the closest valid flag; an
    unknown setting of a class_path is one line with the class's settings."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.yaml").write_text("trainer:\n  max_epochs: 2\n  devices: [1,\n")
    (tmp_path / "ok.yaml").write_text("trainer:\n  max_epochs: 2\n")
    (tmp_path / "typo.yaml").write_text("model:\n  net:\n    hiden_dim: 64\n")
    (tmp_path / "model.yaml").write_text("decode:\n  beam_sise: 3\n")
    (tmp_path / "source.yaml").write_text("data:\n  source:\n    class_path: "
                                          "captioning.data.sources.ShapesSource\n"
                                          "    init_args:\n      rot: data/shapes\n")
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "comments.yaml").write_text("# only a comment\n")
    (tmp_path / "list.yaml").write_text("- trainer\n")
    (tmp_path / "value.yaml").write_text("model:\n  net:\n    embed_dim: sixtyfour\n")
    settings = "root, num_train, num_val, num_test, image_size, seed, boxes_path"
    no_settings = ("no settings (an empty file, or comments only); a config is a YAML mapping "
                   "such as `trainer:` / `model:` / `data:` sections")
    cases = [
        (["--config", "empty.yaml"], f"error: empty.yaml: {no_settings}"),
        (["--config", "comments.yaml"], f"error: comments.yaml: {no_settings}"),
        (["--config", "list.yaml"],
         "error: list.yaml: a config is a YAML mapping of settings, got a list"),
        # A bad value from a file names the file, not a flag the user never typed.
        (["--config", "ok.yaml", "--config", "value.yaml"],
         "error: value.yaml: model.net.embed_dim: invalid value 'sixtyfour' (expected int)"),
        (["--model.net.embed_dim", "sixtyfour"],
         "error: --model.net.embed_dim: invalid value 'sixtyfour' (expected int)"),
        (["--config", "ok.yaml", "--config", "broken.yaml"],
         "error: broken.yaml: invalid YAML at line 4, column 1: expected the node content, but "
         "found '<stream end>' (while parsing a flow node at line 4, column 1)"),
        (["--config", "ok.yaml", "--config=typo.yaml"],
         "error: typo.yaml: Subcommand 'fit' does not accept option 'model.net.hiden_dim'; did "
         "you mean model.net.hidden_dim?"),
        (["--model", "model.yaml"],
         "error: model.yaml: Subcommand 'fit' does not accept option 'model.decode.beam_sise'; "
         "did you mean model.decode.beam_size?"),
        (["--model.net.hiden_dim", "64"],
         "error: unrecognized arguments: --model.net.hiden_dim 64; did you mean "
         "--model.net.hidden_dim?"),
        # An unknown setting of a class_path (jsonargparse says it in ten lines).
        (["--config", "source.yaml"],
         f"error: source.yaml: data.source: ShapesSource does not accept 'rot' (its settings: "
         f"{settings}); did you mean data.source.init_args.root?"),
        (["--data.source", "ShapesSource", "--data.source.init_args.rot", "x"],
         f"error: data.source: ShapesSource does not accept 'rot' (its settings: {settings}); "
         "did you mean data.source.init_args.root?"),
    ]
    for args, want in cases:
        assert main(["fit", *args, "--trainer.logger", "false"]) == 2
        assert error_lines(capsys.readouterr().err) == [want]


def test_a_gpu_config_without_a_gpu_says_to_use_the_cpu(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    for accelerator in (CUDAAccelerator, MPSAccelerator):  # this machine has no GPU
        monkeypatch.setattr(accelerator, "is_available", staticmethod(lambda: False))
    cfg = cli_config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    for accelerator, words in (("gpu", "No supported gpu backend found!"),
                               ("cuda", "`CUDAAccelerator` can not run on your system")):
        assert main(["fit", "--config", str(cfg), "--trainer.accelerator", accelerator]) == 2
        (line,) = error_lines(capsys.readouterr().err)
        assert line.startswith(f"error: {words}")
        assert line.endswith("(no GPU is usable on this machine: use --config trainer/cpu or "
                             "--trainer.accelerator cpu)")


def test_python_m_captioning_is_the_captioning_command(tmp_path: Path) -> None:
    """`python -m captioning` runs `captioning.cli.main`, the console script's entry point."""
    import tomllib

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert scripts["project"]["scripts"]["captioning"] == "captioning.cli:main"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run = [sys.executable, "-m", "captioning"]
    proc = subprocess.run([*run, "--help"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: captioning [--import MODULE")
    proc = subprocess.run([*run, "fit", "--config", "missing.yaml"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env=env)
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [
        "error: missing.yaml: no such file, and no shipped config of that name (`captioning "
        "configs` lists them)"]


def test_parser_error_line() -> None:
    assert parser_error_line('Parser key "data.on_bad_data":\n  Expected a typing.Literal['
                             "'fail', 'skip']. Got value: maybe") == \
        "--data.on_bad_data: invalid value 'maybe' (expected one of 'fail', 'skip')"
    assert parser_error_line("unrecognized arguments: --x") == "unrecognized arguments: --x"
    assert parser_error_line('Parser key "a":\n  Problem:\n    deep') == "--a: Problem: deep"


def test_bugs_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(argv: Any) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr("captioning.commands.shapes.main", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["shapes"])


def test_user_given_settings_are_found_in_flags_and_config_files(tmp_path: Path) -> None:
    from captioning.commands.lightning import given

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"decode": {"beam_size": 5},
                                             "net": {"hard_decode": "argmax"}}}))
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump({"init_args": {"decode": {"max_len": 9}}}))
    args = ["test", "--config", str(cfg), "--model", str(model),
            "--model.decode.length_penalty=0.5", "--model.results_dir", "out"]
    assert given(args, "model.decode.beam_size") and given(args, "model.net.hard_decode")
    assert given(args, "model.decode.max_len") and given(args, "model.decode.length_penalty")
    assert given(args, "model.results_dir")
    assert not given(args, "model.decode.strategy")
    assert not given(args, "model.decode.forbid_unk")
    assert not given(["test", "--config", str(tmp_path / "missing.yaml")],
                     "model.decode.beam_size")
