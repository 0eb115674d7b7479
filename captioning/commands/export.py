"""`captioning export --checkpoint CKPT --out DIR [--force]`: a shareable model folder.

Writes DIR/model.safetensors, config.json, vocab.json and README.md (a model card) from a
Lightning or inference checkpoint, or from another exported folder (see
`captioning.models.pretrained`). The folder loads with no pickle at all:
`captioning caption --checkpoint DIR ...`, `Captioner.from_pretrained(DIR)` in Python, and
`--data.vocab_path DIR/vocab.json` to train or evaluate with its words.

The card says what the checkpoint records of its run: the data module's settings (data source,
image size, vocabulary options), the training step and settings, the ModelCheckpoint scores, and
the `test_metrics.json` / `val_metrics.json` found in the run folder (the checkpoint's folder or
the one above it).

Exit status: 0 written (the folder's path is printed on stdout); 2 a bad argument, a non-empty
--out without --force, an unusable checkpoint or an unwritable folder (one `error:` line).
Torch is imported only after the arguments are checked.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from captioning.commands.caption import output_problem
from captioning.commands.errors import error

if TYPE_CHECKING:
    from captioning.checkpoint import LoadedModel


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="captioning export",
        description="Export a checkpoint as a shareable model folder: model.safetensors, "
                    "config.json, vocab.json and a README.md model card; it loads without "
                    "pickle (captioning caption --checkpoint DIR, Captioner.from_pretrained).")
    p.add_argument("--checkpoint", required=True,
                   help="a training or inference checkpoint (or an exported model folder)")
    p.add_argument("--out", required=True, metavar="DIR", help="the model folder to write")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty DIR, replacing its model files (other files "
                        "in it are kept)")
    return p


def _out_problem(out: Path, force: bool) -> str | None:
    if why := output_problem(out, folder=True):  # a file there, or on its way
        return f"--out {out}: {why}"
    if out.is_dir() and not force and any(out.iterdir()):
        return f"--out {out}: the folder is not empty; pass --force to replace the model files in it"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    try:
        a = _parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error (argparse printed the message)
        return int(e.code) if isinstance(e.code, int) else 2
    out = Path(a.out)
    problem = _out_problem(out, a.force)
    if problem is not None:
        error(problem)
        return 2

    from captioning.checkpoint import CheckpointError, load_checkpoint

    try:
        model = load_checkpoint(a.checkpoint, map_location="cpu")
        data = run_record(model)
        card = build_card(model, data, folder=str(out))
    except CheckpointError as e:
        error(str(e))
        return 2
    try:
        model.captioner.save_pretrained(out, vocab=model.vocab, decode=model.decode, card=card,
                                        training=loss_settings(model, data),
                                        trained_on=trained_on(model, data))
    except OSError as e:
        error(f"--out {out}: cannot write the model folder ({e.strerror or e})")
        return 2
    print(out, flush=True)
    return 0


# -- the model card -----------------------------------------------------------------------------
def run_record(model: LoadedModel) -> Mapping[str, Any]:
    """What `model`'s checkpoint file holds besides the weights ({} for a model folder)."""
    from captioning.checkpoint import read_checkpoint

    if model.path is None or not model.path.is_file():
        return {}
    return read_checkpoint(model.path, "cpu", mmap=True)  # tensors stay on disk


def loss_settings(model: LoadedModel, data: Mapping[str, Any]) -> dict[str, Any]:
    """The run's loss settings (`LOSS_SETTINGS`): from the checkpoint's hyperparameters (`data`),
    or from a model folder's config.json; {} where neither records them."""
    from captioning.checkpoint import upgrade_hparams
    from captioning.models.pretrained import CONFIG_FILE, read_config
    from captioning.objectives import LOSS_SETTINGS

    if model.path is not None and model.path.is_dir():
        return read_config(model.path / CONFIG_FILE)[2]
    hp = upgrade_hparams(dict(data.get("hyper_parameters") or {}))
    return {k: _plain(hp[k]) for k in LOSS_SETTINGS if k in hp}


def trained_on(model: LoadedModel, data: Mapping[str, Any]) -> dict[str, Any]:
    """The data source the run read and the rule that carved its val and test (None: before
    the rule was recorded): from the checkpoint (`data`), or a model folder's; {} where the
    checkpoint has no data module settings."""
    from captioning.data.carving import CARVING_KEY

    if model.path is not None and model.path.is_dir():
        return dict(model.captioner.trained_on)
    hp = data.get("datamodule_hyper_parameters")
    if not isinstance(hp, Mapping) or hp.get("source") is None:
        return {}
    return {"source": _plain(hp["source"]), "carving": _plain(data.get(CARVING_KEY))}


def build_card(model: LoadedModel, data: Mapping[str, Any], *, folder: str) -> str:
    """The README.md of `model`'s folder, with what its checkpoint (`data`) records of the run."""
    from captioning.models.pretrained import model_card

    source = model.path
    config = {**model.captioner.config.to_dict(), "weights": None}
    sections = [("Source", _source_text(model, data)),
                ("Training data", _data_text(data)),
                ("Results", _results_text(source, data))]
    return model_card(config, model.decode.to_dict(), len(model.vocab), folder=folder,
                      sections=sections)


def _plain(value: Any) -> Any:
    """JSON-able: 0-d tensors -> numbers, containers recursively, other objects as text."""
    if hasattr(value, "ndim") and getattr(value, "ndim", 1) == 0 and hasattr(value, "item"):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _source_text(model: LoadedModel, data: Mapping[str, Any]) -> str:
    path = model.path
    if path is None or not data:
        return f"Exported from the model folder `{path}`." if path else "Not recorded."
    lines = [f"Exported from the checkpoint `{path.name}` (`{path}`)."]
    if "global_step" in data:
        lines.append(f"Saved after epoch {data.get('epoch')} at training step "
                     f"{data['global_step']}.")
    weights = model.config.weights
    lines.append(f"The encoder started from the `{weights}` weights of `{model.config.backbone}`"
                 if weights else f"The encoder `{model.config.backbone}` started from random "
                 "weights")
    lines[-1] += " and was fine-tuned." if model.config.finetune_encoder else " and was frozen."
    hp = {k: v for k, v in (data.get("hyper_parameters") or {}).items()
          if k not in ("net", "decode") and not str(k).startswith("_")}
    if hp:
        from captioning.models.pretrained import json_block

        lines.append("Training settings (the LightningModule's hyperparameters):\n\n"
                     + json_block(_plain(hp)))
    return "\n".join(lines)


def _data_text(data: Mapping[str, Any]) -> str:
    hp = data.get("datamodule_hyper_parameters")
    if not isinstance(hp, Mapping) or not hp:
        return ("Not recorded in the checkpoint (an inference checkpoint, or one trained "
                "without the data module).")
    from captioning.models.pretrained import json_block

    source = hp.get("source")
    head = ""
    if isinstance(source, Mapping) and source.get("class_path"):
        head = f"Data source `{str(source['class_path']).rpartition('.')[2]}`. "
    return (head + "The data module's settings, as recorded in the checkpoint:\n\n"
            + json_block(_plain(hp)))


def _results_text(source: Path | None, data: Mapping[str, Any]) -> str:
    parts = [_checkpoint_scores(source, data)]
    for file in _metrics_files(source):
        parts.append(_metrics_table(file))
    parts = [p for p in parts if p]
    return "\n\n".join(parts) if parts else \
        "No scores were found in the checkpoint or beside it (no test_metrics.json)."


def _checkpoint_scores(source: Path | None, data: Mapping[str, Any]) -> str:
    """The ModelCheckpoint callbacks' monitored scores."""
    lines = []
    for key, state in (data.get("callbacks") or {}).items():
        if not str(key).startswith("ModelCheckpoint") or not isinstance(state, Mapping):
            continue
        monitor = state.get("monitor")
        best, current = _number(state.get("best_model_score")), \
            _number(state.get("current_score"))
        if not monitor or (best is None and current is None):
            continue
        if current is not None:
            lines.append(f"- `{monitor}` when this checkpoint was saved: {current:.4f}")
        if best is not None:
            best_file = Path(str(state.get("best_model_path") or "")).name
            mine = source is not None and best_file == source.name
            lines.append(f"- best `{monitor}` of the run: {best:.4f} (`{best_file}`"
                         f"{', this checkpoint' if mine else ''})")
    return "\n".join(dict.fromkeys(lines))


def _number(value: Any) -> float | None:
    value = _plain(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _metrics_files(source: Path | None) -> list[Path]:
    """test_metrics.json / val_metrics.json in the run folder: the checkpoint's folder, or the
    one above it (runs/NAME/checkpoints/x.ckpt); the nearest of each."""
    if source is None or not source.is_file():
        return []
    from captioning.evaluation import results_files  # what `test` / `validate` write

    found = []
    for split in ("test", "val"):
        for folder in (source.parent, source.parent.parent):
            if (metrics := results_files(folder, split)[1]).is_file():
                found.append(metrics)
                break
    return found


def _metrics_table(file: Path) -> str:
    try:
        metrics = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    if not isinstance(metrics, Mapping) or not metrics:
        return ""
    split = file.name.split("_")[0]
    rows = [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
            for k, v in metrics.items()]
    return (f"{'Test' if split == 'test' else 'Validation'} metrics of the run, from "
            f"`{file}` (written by the run's latest `captioning "
            f"{'test' if split == 'test' else 'validate'}`, which does not record the "
            "checkpoint it evaluated):\n\n| metric | value |\n|---|---|\n" + "\n".join(rows))
