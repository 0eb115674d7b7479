"""`captioning predict --checkpoint CKPT|DIR INPUTS... --out captions.json`: caption a large set
of images through Lightning's `Trainer.predict`, on one device or many (DDP).

Inputs are image files, folders, glob patterns (as for `captioning caption`) and list files:
an argument `@FILE`, or one ending in `.txt` / `.lst`, is a text file naming one image per line
(blank lines and `#` comments skipped; relative paths are resolved against the list file's
folder; folders and globs work there too). Decoding follows the checkpoint's settings (a beam
search, as `caption` decodes), with `--beam-size` / `--max-len` overrides, or with `--sample`
(and `--temperature`) one sampled caption per image. `--num-captions N` keeps the N best beams
(or N samples) of each image in a `captions` list beside its best `caption`.

Writes `--out` (COCO-style results: a JSON list, in input order, of `{"file_name", "caption",
"score"}`), optionally the α maps (`--alphas`, one `.npz` per image) and overlay strips
(`--overlays DIR`): see `captioning.callbacks.CaptionWriter`. Images that cannot be loaded are
reported on stderr (`error: path: reason`) and skipped. Exit status: 0 every image captioned,
1 some inputs failed, 2 bad arguments, nothing to caption or an unusable checkpoint.

With `--devices N --strategy ddp` Lightning re-runs this command line once per extra rank, so
several devices need the command run from a shell (not `main([...])` in a notebook).
Lightning and torch are imported only after the arguments are parsed.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from captioning.commands.caption import (
    Inputs,
    add_decoding_flags,
    decoding_settings,
    each_file_once,
    expand_arg,
    output_problem,
    overlay_names,
    resolved,
)
from captioning.commands.errors import error
from captioning.launch import launcher_rank_zero

if TYPE_CHECKING:
    from captioning.checkpoint import LoadedModel
    from captioning.lit_module import CaptioningModule
    from captioning.models.captioner import DecodeConfig
    from captioning.models.fixed_beam import FastBeamSetting

log = logging.getLogger(__name__)

LIST_EXTENSIONS = frozenset({".txt", ".lst"})
_DEVICES = re.compile(r"auto|-1|\d+(,\d+)*,?")


def is_list_file(arg: str) -> bool:
    """`@FILE`, or a name ending in .txt / .lst: a file naming one image per line."""
    return arg.startswith("@") or Path(arg).suffix.lower() in LIST_EXTENSIONS


def list_path(arg: str) -> Path:
    """The file of a list-file argument (`@FILE` or FILE)."""
    return Path(arg[1:] if arg.startswith("@") else arg)


def read_list_file(arg: str) -> tuple[list[tuple[int, str]], str | None]:
    """The (line number, entry) pairs of a list file (relative entries joined to its folder),
    or a problem."""
    path = list_path(arg)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM (Notepad) is not part of line 1
    except FileNotFoundError:
        return [], f"{path}: list file does not exist"
    except (OSError, UnicodeDecodeError) as e:
        return [], f"{path}: cannot read the list file ({getattr(e, 'strerror', None) or e})"
    entries = [(n, str(path.parent / e)) for n, ln in enumerate(text.splitlines(), 1)
               if (e := ln.strip()) and not e.startswith("#")]
    return entries, None if entries else f"{path}: list file names no images"


def expand_predict_inputs(args: Sequence[str]) -> Inputs:
    """List files replaced by their entries, each argument and entry expanded by `expand_arg`
    (folders, globs, files; each path once, at its first occurrence). A list entry that names
    nothing is reported with its list file and line."""
    paths: list[Path] = []
    problems: list[str] = []
    for arg in args:
        if not is_list_file(arg):
            found, problem = expand_arg(arg)
            paths += found
            problems += [problem] if problem else []
            continue
        entries, problem = read_list_file(arg)
        problems += [problem] if problem else []
        where = list_path(arg)
        for line, entry in entries:
            found, problem = expand_arg(entry)
            if problem is None and not any(p.exists() for p in found):
                problem = f"{entry}: image file does not exist"
            if problem is not None:
                problems.append(f"{where}, line {line}: {problem}")
            else:
                paths += found
    return Inputs(each_file_once(paths), problems)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="captioning predict",
        description="Caption many images with Trainer.predict (one device or DDP) into a "
                    "COCO-style results JSON.")
    p.add_argument("inputs", nargs="*", metavar="IMAGE|DIR|GLOB|LIST",
                   help="image files, folders, glob patterns (quote them) or list files "
                        "(@FILE, *.txt, *.lst: one image path per line)")
    p.add_argument("--checkpoint", required=True,
                   help="a training or inference checkpoint, or an exported model folder")
    p.add_argument("--out", required=True, help="the results JSON to write")
    p.add_argument("--alphas", action="store_true",
                   help="also write each image's attention maps, NAME.npz in OUT-STEM_alphas/ "
                        "beside --out")
    p.add_argument("--overlays", "--overlay", dest="overlays", metavar="DIR", default=None,
                   help="write one attention strip PNG per image into DIR")
    add_decoding_flags(p, captions_help="captions per image: the N best beams (N <= beam "
                                        "size), or N samples with --sample; the record's "
                                        "`captions` list holds them all")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch and device")
    p.add_argument("--num-workers", type=int, default=2, help="image loading processes per rank")
    p.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--devices", default="1",
                   help="N devices, a list such as 0,1, or auto (default: 1)")
    p.add_argument("--strategy", choices=("auto", "ddp"), default="auto",
                   help="ddp for several devices or nodes")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--precision", default=None,
                   help="Lightning precision, e.g. 32-true, 16-mixed, bf16-mixed")
    return p


def _checked_args(a: argparse.Namespace) -> bool:
    """Whether the numbers and the device spec make sense (else one error line)."""
    limits = {"beam_size": 1, "max_len": 1, "num_captions": 1, "batch_size": 1,
              "num_workers": 0, "num_nodes": 1}
    for name, low in limits.items():
        value = getattr(a, name)
        if value is not None and value < low:
            error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
            return False
    if not _DEVICES.fullmatch(a.devices):
        error(f"--devices: expected a count, a list such as 0,1, or auto, got {a.devices!r}")
        return False
    if Path(a.out).is_dir():
        error(f"--out {a.out}: is a folder; give the JSON file to write")
        return False
    for flag, value, folder in (("--out", a.out, False), ("--overlays", a.overlays, True)):
        if value and (why := output_problem(value, folder=folder)):
            error(f"{flag} {value}: {why}")
            return False
    if not a.inputs:
        error("no inputs: give image files, folders, glob patterns or list files")
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = _parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error (argparse printed the message)
        return int(e.code) if isinstance(e.code, int) else 2
    if not _checked_args(a):
        return 2
    inputs = expand_predict_inputs(a.inputs)
    rank_zero = launcher_rank_zero()
    for msg in inputs.problems if rank_zero else []:
        error(msg)
    if not inputs.paths:
        if rank_zero:
            error("no images to caption")
        return 2
    out = resolved(Path(a.out))
    if any(resolved(p) == out for p in inputs.paths):
        if rank_zero:
            error(f"--out {a.out}: is one of the input images; give another file to write")
        return 2

    from captioning.checkpoint import CheckpointError, load_checkpoint

    try:
        model = load_checkpoint(a.checkpoint, map_location="cpu")
        decode = decoding_settings(model.decode, a)
    except (CheckpointError, ValueError) as e:
        error(str(e))
        return 2
    start = time.perf_counter()
    result = _predict(a, argv, model, decode, inputs.paths)
    if result is None:
        return 2
    captioned, failed, is_zero = result
    failed += len(inputs.problems)
    if is_zero:
        log.info("captioned %d image(s) in %.1f s -> %s%s", captioned,
                 time.perf_counter() - start, a.out, f", {failed} failed" if failed else "")
    return 1 if failed else 0


def build_module(model: LoadedModel, decode: DecodeConfig, fast_beam: FastBeamSetting = "auto"
                 ) -> CaptioningModule:
    """A `CaptioningModule` (eval mode) holding a loaded model's weights and vocabulary,
    decoding with `decode` (`decoding_settings`: the checkpoint's, overridden as `captioning
    caption` does)."""
    from dataclasses import replace

    from captioning.lit_module import CaptioningModule

    module = CaptioningModule(net=replace(model.config, weights=None),  # no download
                              decode=decode, compute_metrics=False,
                              fast_beam=fast_beam)
    module.captioner.load_state_dict(model.captioner.state_dict())
    module.vocab = model.vocab
    return module.eval()


def _predict(a: argparse.Namespace, argv: list[str], model: LoadedModel, decode: DecodeConfig,
             paths: list[Path]) -> tuple[int, int, bool] | None:
    """Run `Trainer.predict`: (captioned, failed, is global zero), or None after reporting
    an unusable trainer setting."""
    import lightning.pytorch as L
    import torch
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from captioning.callbacks.predictions import CaptionWriter
    from captioning.data.predict import predict_loader
    from captioning.distributed import end_process_group

    writer = CaptionWriter(a.out, alphas=a.alphas, overlays=a.overlays,
                           names=overlay_names(paths, Path(a.overlays) if a.overlays else None))
    devices: Any = int(a.devices) if a.devices.lstrip("-").isdigit() else a.devices
    try:
        trainer = L.Trainer(accelerator=a.accelerator, devices=devices, strategy=a.strategy,
                            num_nodes=a.num_nodes, precision=a.precision, logger=False,
                            enable_checkpointing=False, enable_model_summary=False,
                            enable_progress_bar=sys.stdout.isatty(), callbacks=[writer])
    except (MisconfigurationException, ValueError, RuntimeError) as e:
        error(f"cannot set up the trainer: {e}")
        return None
    if _relaunches(trainer) and argv != sys.argv[len(sys.argv) - len(argv):]:
        error("several processes re-run the command line: run `captioning predict` from a "
              "shell (or use --devices 1)")
        return None
    loader = predict_loader(paths, model.config.image_size, batch_size=a.batch_size,
                            num_workers=a.num_workers, world_size=trainer.num_devices * a.num_nodes,
                            pin_memory=a.accelerator != "cpu" and torch.cuda.is_available())
    ended = False
    try:
        trainer.predict(build_module(model, decode, a.fast_beam), dataloaders=loader,
                        return_predictions=False)
        ended = True
    finally:  # the ranks leave together, with no process-group thread left running at exit
        if trainer.world_size > 1:
            end_process_group(barrier=ended)  # a failed rank: no barrier the others miss
    return writer.captioned, writer.failed, trainer.is_global_zero


def _relaunches(trainer: Any) -> bool:
    """Whether Lightning will start the other ranks by re-running `sys.argv`."""
    launcher = getattr(trainer.strategy, "launcher", None)
    env = getattr(trainer.strategy, "cluster_environment", None)
    return (type(launcher).__name__ == "_SubprocessScriptLauncher" and env is not None
            and not env.creates_processes_externally)
