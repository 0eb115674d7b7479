"""Training-speed benchmark. Prints one table.

    python scripts/benchmark.py                      # CPU: paper-size decoder, mobilenet_v2
    python scripts/benchmark.py --encoder vgg19      # CPU: paper-size decoder, the paper's CNN
    python scripts/benchmark.py --device cuda --precision bf16-mixed --paper

Rows (each measured in fresh subprocesses, so that peak memory is per row; the training rows
in `--rounds` interleaved rounds, so that a busy spell of a shared machine is spread over all
of them):

* training captions/s through the real `CaptionDataModule` + `CaptioningModule` + Lightning
  `Trainer`, with the encoder's features cached (the CNN never runs) or not (the frozen CNN
  runs on every batch), soft and hard attention; cached soft also without length bucketing
  and with `compile: true`;
* beam-search captions/s on cached features (<end> disabled, so every caption runs
  `--max-len` steps: an untrained decoder would otherwise stop at once);
* the COCO-size index build: a synthetic Karpathy file of 123,287 images / 616,767 captions
  (images need not exist: `validate_images=False`), timed through read + vocabulary +
  dataset encoding.

Columns (training: medians over the timed steps, robust to other processes on a shared
machine; the means go to --json): captions/s; ms per step (the training step itself:
forward, backward, optimiser); data wait, the time between one step's end and the next step's
start (loading and collating the batch, and Lightning's own work) as a share of the step-to-step
time; padding, the share of decoder step-rows (caption x time step)
of the padded (B, T) batches that are padding (the decoder skips them by shrinking its active
batch, but without bucketing the batches are padded much more); peak memory, the worker's
peak RSS (`resource.getrusage`) on CPU or `torch.cuda.max_memory_allocated` on a GPU.

Defaults (CPU): encoder mobilenet_v2 (random weights) at 224 px, frozen (7x7x1280 grid), or
`--encoder vgg19`, the paper's conv5_4 (14x14x512); decoder embedding, attention and LSTM 512;
batch 32. `--paper`: VGG-19 conv5_4 (14x14x512) at 224 px, LSTM 1800,
batch 64, and synthetic COCO-like captions (10k-word vocabulary) over the shapes images.
`--tiny`: 64 px images and a 32-unit decoder, to check that every row runs. The model and
data are built by `captioning fit`'s own parser from the project's configs.
Everything is written to a temporary folder (or --workdir).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmark")

RESULT = "BENCHMARK-RESULT "
# Karpathy's COCO split: 113,287 train (82,783 train + 30,504 restval), 5,000 val, 5,000 test.
COCO_SPLITS = {"train": 82_783, "restval": 30_504, "val": 5_000, "test": 5_000}
COCO_CAPTIONS = 616_767


# ---------------------------------------------------------------------------------------------
# Synthetic COCO-size Karpathy file


def make_coco_karpathy(path: Path, *, splits: dict[str, int] | None = None,
                       captions: int = COCO_CAPTIONS, filenames: list[str] | None = None,
                       filepath: str = "", seed: int = 0) -> Path:
    """Write a Karpathy split file shaped like dataset_coco.json.

    Captions are 5 per image (a few get 6 or 7, up to `captions`), 8 to 25 words (mean ~10.5,
    like COCO), drawn from a Zipf-distributed 30k-word vocabulary (about 10k words occur 5
    times or more). `filenames` cycles through existing images; default: names that need not
    exist.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    splits = splits or COCO_SPLITS
    n_images = sum(splits.values())
    per_image = np.full(n_images, 5, dtype=np.int64)
    extra = rng.choice(n_images, size=max(0, captions - 5 * n_images), replace=True)
    np.add.at(per_image, extra, 1)
    n_caps = int(per_image.sum())
    lengths = np.clip(rng.poisson(2.5, n_caps) + 8, 8, 25)
    ranks = np.arange(1, 30_001)
    p = 1.0 / ranks**1.07
    words = [_pseudo_word(i) for i in range(len(ranks))]
    flat = rng.choice(len(ranks), size=int(lengths.sum()), p=p / p.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    split_of = np.repeat(list(splits), list(splits.values()))
    images, sent, cap = [], 0, 0
    for i in range(n_images):
        sentences = []
        for _ in range(per_image[i]):
            tokens = [words[w] for w in flat[offsets[cap]: offsets[cap + 1]]]
            sentences.append({"tokens": tokens, "raw": " ".join(tokens).capitalize() + ".",
                              "imgid": i, "sentid": sent})
            sent += 1
            cap += 1
        name = filenames[i % len(filenames)] if filenames else \
            f"COCO_{split_of[i]}2014_{i:012d}.jpg"
        images.append({"filepath": filepath, "sentids": [s["sentid"] for s in sentences],
                       "filename": name, "imgid": i, "split": str(split_of[i]),
                       "sentences": sentences, "cocoid": i + 1})
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        json.dump({"images": images, "dataset": "coco"}, f)
    return path


def _pseudo_word(i: int) -> str:
    """A distinct lowercase word for every index (base-20 syllables)."""
    syll = ["ka", "lo", "mi", "ne", "pu", "ra", "si", "to", "vu", "we",
            "ba", "de", "fi", "go", "hu", "ja", "ku", "le", "mo", "ny"]
    out = ""
    i += 1
    while i:
        i, r = divmod(i, len(syll))
        out += syll[r]
    return out


# ---------------------------------------------------------------------------------------------
# Workers (run in a subprocess each)


def _peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _build(spec: dict[str, Any], *, cached: bool) -> tuple[Any, Any]:
    """(CaptioningModule, CaptionDataModule) through `captioning fit`'s own parser, from the
    project's configs (paper_soft.yaml with --paper, else demo_soft.yaml at benchmark sizes)."""
    from captioning.commands.configs import CONFIG_DIR
    from captioning.commands.lightning import lightning_cli

    karpathy = bool(spec.get("split_file"))
    args = ["--config", str(CONFIG_DIR / "data" / ("coco.yaml" if karpathy else
                                                          "shapes.yaml")),
            "--config", str(CONFIG_DIR / "model" / ("paper_soft.yaml" if spec["paper"] else
                                                    "demo_soft.yaml"))]
    dims = 32 if spec.get("tiny") else 512
    net: dict[str, Any] = {"weights": None, "attention": spec["attention"],
                           "channels_last": spec["channels_last"]}
    if not spec["paper"]:
        net.update(backbone=spec["encoder"], grid_size=None, embed_dim=dims, hidden_dim=dims,
                   attn_dim=dims, dropout=0.5)
    data: dict[str, Any] = {
        "image_size": spec["image_size"], "batch_size": spec["batch_size"],
        "eval_batch_size": spec["batch_size"], "num_workers": spec["num_workers"],
        "pin_memory": spec["device"].startswith("cuda"),
        "persistent_workers": spec["num_workers"] > 0,
        "length_bucketing": spec.get("bucketing", True), "feature_cache": cached,
        "cache_dir": spec["cache_dir"], "validate_images": False, "vocab_path": None}
    if karpathy:
        data.update({"source.split_file": spec["split_file"],
                     "source.image_root": spec["image_root"]})
    else:
        data.update({"source.root": spec["root"], "min_word_count": 1,
                     **{f"source.{k}": v for k, v in spec["shapes"].items()}})
    model = {"compute_metrics": False, "compile": spec["compile"],
             "decode.beam_size": spec.get("beam_size", 3),
             "decode.max_len": spec.get("max_len", 20),
             **{f"net.{k}": v for k, v in net.items()}}
    for group, values in (("model", model), ("data", data)):
        for k, v in values.items():
            args += [f"--{group}.{k}", "null" if v is None else str(v)]
    cli = lightning_cli([*args, "--trainer.logger", "false"], run=False)
    return cli.model, cli.datamodule


def _attach_cache(module: Any, dm: Any, device: str) -> None:
    """The feature cache, through `fit`'s one attach path."""
    from captioning.data.features import attach_feature_cache

    captioner = module.captioner
    attach_feature_cache(dm, captioner.encoder, captioner.feature_cache_key(), device=device)


def worker_train(spec: dict[str, Any]) -> dict[str, Any]:
    """Train `warmup + steps` steps through Lightning; time the last `steps`."""
    import lightning.pytorch as L
    import torch

    L.seed_everything(0, verbose=False)
    device = spec["device"]
    cuda = device.startswith("cuda")
    module, dm = _build(spec, cached=spec["cached"])
    notes: list[str] = []
    if spec["cached"]:  # build (or find) the cache before timing anything
        t0 = time.perf_counter()
        _attach_cache(module, dm, device)
        n = len(dm.cache_features(["train", "val"])["train"])
        notes.append(f"cache of {n} train images: {time.perf_counter() - t0:.0f} s")

    class StepTimer(L.Callback):
        """Per timed step: compute time (batch start to end) and the wait before it."""

        def __init__(self) -> None:
            self.i, self.last_end, self.t_start, self.first_steps = 0, 0.0, 0.0, 0.0
            self.steps: list[float] = []
            self.waits: list[float] = []
            self.sizes: list[int] = []
            self.rows = self.real = 0

        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            self.t_start = self._now()
            if self.i >= spec["warmup"]:
                self.waits.append(self.t_start - self.last_end)
            if self.i == spec["warmup"] and cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.last_end = self._now()
            if self.i < spec["warmup"]:
                self.first_steps += self.last_end - self.t_start
            else:
                self.steps.append(self.last_end - self.t_start)
                steps = (batch.lengths - 1).clamp_min(0)
                self.rows += int(steps.max()) * len(steps)
                self.real += int(steps.sum())
                self.sizes.append(len(steps))
            self.i += 1

    timer = StepTimer()
    precision = spec["precision"]
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision=precision,
                        max_steps=spec["warmup"] + spec["steps"], limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer], default_root_dir=spec["workdir"],
                        gradient_clip_val=5.0)
    trainer.fit(module, datamodule=dm)
    if spec["compile"]:
        notes.append(f"{spec['warmup']} warm-up steps incl. compiling: {timer.first_steps:.0f} s")
    if spec.get("save_weights"):
        torch.save(module.state_dict(), spec["save_weights"])
    return {"steps": timer.steps, "waits": timer.waits, "sizes": timer.sizes,
            "rows": timer.rows, "real": timer.real, "peak_mb": _peak_memory_mb(device),
            "notes": "; ".join(notes), "vocab": dm.vocab_size}


def summarize_train(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the timed steps of every round: medians (robust to other processes on a shared
    machine) and means."""
    steps = [x for r in rounds for x in r["steps"]]
    waits = [x for r in rounds for x in r["waits"]]
    sizes = [x for r in rounds for x in r["sizes"]]
    total = [a + b for a, b in zip(steps, waits)]
    return {"captions_per_s": statistics.median(n / t for n, t in zip(sizes, total)),
            "step_ms": 1e3 * statistics.median(steps),
            "wait": statistics.median(waits) / statistics.median(total),
            "mean_captions_per_s": sum(sizes) / sum(total), "mean_wait": sum(waits) / sum(total),
            "padding": 1 - sum(r["real"] for r in rounds) / max(1, sum(r["rows"] for r in rounds)),
            "peak_mb": max(r["peak_mb"] for r in rounds), "timed_steps": len(steps),
            "per_round_captions_per_s": [sum(r["sizes"]) / (sum(r["steps"]) + sum(r["waits"]))
                                         for r in rounds],
            "notes": rounds[0]["notes"]}


def worker_beam(spec: dict[str, Any]) -> dict[str, Any]:
    """Beam search on the cached val features, every caption `max_len` steps."""
    import lightning.pytorch as L
    import torch

    from captioning.models.decoding import SpecialIds

    L.seed_everything(0, verbose=False)
    device = torch.device(spec["device"])
    module, dm = _build(spec, cached=True)
    _attach_cache(module, dm, spec["device"])
    if spec.get("weights") and Path(spec["weights"]).exists():
        module.load_state_dict(torch.load(spec["weights"], map_location="cpu"))
    with torch.no_grad():
        module.captioner.decoder.out.bias[SpecialIds().end] = -1e4
    module.to(device).eval()
    ds = dm.dataset_for("val")
    feats = torch.stack([ds[i][0] for i in range(min(len(ds), spec["beam_images"]))]).to(device)
    b = spec["batch_size"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=spec["precision"] == "bf16-mixed")

    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(0, len(feats), b):
            module.generate(feats[s: s + b])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.inference_mode(), autocast:
        module.generate(feats[:b])  # warm-up
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        dt = statistics.median(run() for _ in range(3))
    return {"captions_per_s": len(feats) / dt, "step_ms": 1e3 * dt / -(-len(feats) // b),
            "peak_mb": _peak_memory_mb(spec["device"]),
            "notes": f"beam {spec['beam_size']}, {spec['max_len']} steps, batch {b}, "
                     f"{len(feats)} images"}


def worker_coco_index(spec: dict[str, Any]) -> dict[str, Any]:
    """Read + vocabulary + dataset encoding of a COCO-size Karpathy file."""
    from captioning.data.datamodule import CaptionDataModule
    from captioning.data.sources import KarpathySplits

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    source = KarpathySplits(split_file=spec["split_file"], image_root=spec["image_root"])
    dm = CaptionDataModule(source=source, validate_images=False, feature_cache=False,
                           min_word_count=5, max_vocab_size=10_000)
    n_train = len(dm.records("train"))
    t_read = time.perf_counter() - t0
    vocab = dm.vocab
    t_vocab = time.perf_counter() - t0 - t_read
    dm.setup("fit")
    dm.setup("test")
    total = time.perf_counter() - t0
    pairs = len(dm.dataset_for("train"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": total, "peak_mb": peak, "base_mb": base, "pairs": pairs,
            "captions_per_s": pairs / total,
            "notes": f"{n_train} train images, {pairs} train captions, vocab {len(vocab)}: "
                     f"read {t_read:.1f} s + vocab {t_vocab:.1f} s + encode "
                     f"{total - t_read - t_vocab:.1f} s = {total:.1f} s; peak RSS "
                     f"{peak:.0f} MB ({peak - base:.0f} MB over the {base:.0f} MB of imports)"}


def worker_padding(spec: dict[str, Any]) -> dict[str, Any]:
    """Padding share of one epoch's batches, bucketed vs random, for a training set."""
    import numpy as np

    from captioning.data.samplers import BucketBatchSampler, EpochShuffleSampler

    _, dm = _build({**spec, "attention": "soft"}, cached=False)
    lengths = np.asarray(dm.dataset_for("train").lengths)
    steps = lengths - 1
    b = spec["batch_size"]

    def waste(batches: list[Any]) -> float:
        rows = sum(int(steps[x].max()) * len(x) for x in batches)
        return 1 - sum(int(steps[x].sum()) for x in batches) / rows

    bucketed = list(BucketBatchSampler(EpochShuffleSampler(len(lengths)), b, lengths=lengths))
    perm = np.random.default_rng(0).permutation(len(lengths))
    plain = [perm[s: s + b] for s in range(0, len(perm), b)]
    return {"bucketed": waste(bucketed), "random": waste(plain), "captions": len(lengths)}


WORKERS = {"train": worker_train, "beam": worker_beam, "coco_index": worker_coco_index,
           "padding": worker_padding}


def _run_worker(spec: dict[str, Any], threads: int | None) -> dict[str, Any]:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    sys.stderr.write(proc.stderr[-5000:])
    raise RuntimeError(f"benchmark worker {spec['kind']} failed (exit {proc.returncode})")


# ---------------------------------------------------------------------------------------------
# Orchestration


def _machine(device: str, threads: int | None) -> str:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}, " \
           f"{threads or torch.get_num_threads()} intra-op thread(s) per run"
    if device.startswith("cuda") and torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name()}"
    return desc


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    p.add_argument("--paper", action="store_true",
                   help="COCO paper configuration: VGG-19 14x14x512, LSTM 1800, batch 64, "
                        "10k-word synthetic COCO captions")
    p.add_argument("--encoder", default="mobilenet_v2", choices=("mobilenet_v2", "vgg19"),
                   help="frozen CNN without --paper (default mobilenet_v2)")
    p.add_argument("--batch-size", type=int, default=None, help="default 32 (64 with --paper)")
    p.add_argument("--steps", type=int, default=24, help="timed training steps per row")
    p.add_argument("--rounds", type=int, default=3,
                   help="split each row's steps over this many interleaved rounds (each a fresh "
                        "process with its own warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, per round")
    p.add_argument("--num-train", type=int, default=640, help="shapes training images")
    p.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader workers (default: 0 cached, 2 uncached on CPU; 4 on GPU)")
    p.add_argument("--channels-last", action="store_true", help="channels_last CNN")
    p.add_argument("--beam-size", type=int, default=3)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--rows", default="uncached,cached,channels_last,nobucket,compile,beam,coco",
                   help="comma-separated subset of: uncached,cached,channels_last,nobucket,"
                        "compile,beam,coco")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per run (default: torch's); use 1 on a machine "
                        "shared with other jobs, where OpenMP thread teams stall")
    p.add_argument("--workdir", default=None, help="keep files here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--tiny", action="store_true",
                   help="64 px images and a 32-unit decoder: checks that every row runs")
    args = p.parse_args(argv)
    args.warmup = max(1, args.warmup)  # the first timed step needs a previous step's end

    if args.worker:
        spec = json.loads(args.worker)
        logging.basicConfig(level=logging.WARNING)
        if spec.get("threads"):
            import torch

            torch.set_num_threads(spec["threads"])
        print(RESULT + json.dumps(WORKERS[spec["kind"]](spec)), flush=True)
        return 0

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = set(args.rows.split(","))
    batch = args.batch_size or (64 if args.paper else 32)
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="captioning-bench-") as tmp_dir:
        work = Path(args.workdir or tmp_dir)
        work.mkdir(parents=True, exist_ok=True)
        from captioning.data.shapes import generate_shapes

        size = 64 if args.tiny else 224
        shapes = {"num_train": args.num_train, "num_val": 8 if args.tiny else 64,
                  "num_test": 0, "image_size": size, "seed": 0}
        t0 = time.perf_counter()
        root = generate_shapes(work / "shapes", **shapes)
        log.info("shapes data ready in %.0f s", time.perf_counter() - t0)
        base = {"device": args.device, "precision": args.precision, "paper": args.paper,
                "encoder": args.encoder,
                "batch_size": batch, "root": str(root),
                "shapes": shapes, "image_size": size, "tiny": args.tiny,
                "cache_dir": str(work / "features"), "workdir": str(work),
                "channels_last": args.channels_last, "steps": args.steps,
                "warmup": args.warmup, "compile": False, "threads": args.threads}
        if args.paper:  # COCO-like captions (10k words) over the shapes images
            names = sorted(p.name for p in (root / "images").glob("*.png"))
            split_file = make_coco_karpathy(
                work / "paper_captions.json", filenames=[n for n in names if n[:5] == "train"],
                splits={"train": 20_000, "val": 64}, captions=0)  # 100k captions
            base.update(split_file=str(split_file), image_root=str(root / "images"))

        results: list[tuple[str, dict[str, Any]]] = []

        configs: list[tuple[str, dict[str, Any]]] = []
        weights = str(work / "cached_soft.pt")
        for attention in ("soft", "hard"):
            if "uncached" in rows:
                configs.append((f"train, uncached, {attention}",
                                {"cached": False, "attention": attention}))
            if "cached" in rows:
                configs.append((f"train, cached, {attention}", {
                    "attention": attention,
                    "save_weights": weights if attention == "soft" else None}))
        if "channels_last" in rows:
            configs.append(("train, uncached, soft, channels_last",
                            {"cached": False, "channels_last": True}))
        if "nobucket" in rows:
            configs.append(("train, cached, soft, no bucketing", {"bucketing": False}))
        if "compile" in rows:
            configs.append(("train, cached, soft, torch.compile",
                            {"compile": True, "warmup": max(args.warmup, 3)}))
        # Interleaved rounds: every configuration runs a share of its steps in each round, so
        # that a busy spell of the machine does not land on one configuration only.
        per_round = -(-args.steps // args.rounds)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
        workers: dict[str, int] = {}
        for r in range(args.rounds):
            for name, kw in configs:
                cached = kw.get("cached", True)
                workers[name] = args.num_workers if args.num_workers is not None else (
                    4 if cuda else (0 if cached else 2))
                spec = {**base, "kind": "train", "attention": "soft", "cached": True,
                        "num_workers": workers[name], **kw, "steps": per_round}
                log.info("round %d/%d: %s", r + 1, args.rounds, name)
                runs[name].append(_run_worker(spec, args.threads))
        for name, _ in configs:
            res = summarize_train(runs[name])
            res["notes"] = "; ".join(x for x in (f"{workers[name]} loader workers",
                                                 res["notes"]) if x)
            results.append((name, res))
        if "beam" in rows:
            log.info("running: beam search")
            res = _run_worker({**base, "kind": "beam", "attention": "soft", "num_workers": 0,
                               "beam_size": args.beam_size, "max_len": args.max_len,
                               "beam_images": shapes["num_val"], "weights": weights},
                              args.threads)
            results.append((f"beam search, cached, soft (beam {args.beam_size})", res))
        padding: dict[str, Any] = {}
        if "coco" in rows:
            log.info("writing a COCO-size Karpathy file")
            t0 = time.perf_counter()
            coco = make_coco_karpathy(work / "coco" / "dataset_coco.json")
            log.info("  written in %.0f s (%.0f MB)", time.perf_counter() - t0,
                     coco.stat().st_size / 2**20)
            log.info("running: COCO-size index build")
            spec = {"kind": "coco_index", "split_file": str(coco),
                    "image_root": str(coco.parent)}
            res = _run_worker(spec, args.threads)
            results.append(("COCO-size index build (123k images)", res))
            padding["COCO-size"] = _run_worker(
                {**base, "kind": "padding", "split_file": str(coco),
                 "image_root": str(coco.parent), "num_workers": 0}, args.threads)
        padding["shapes"] = _run_worker({**base, "kind": "padding", "num_workers": 0,
                                         "split_file": None}, args.threads)

    _print_table(args, batch, results, padding)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": _machine(args.device, args.threads), "args": vars(args),
            "rows": dict(results), "padding": padding}, indent=2))
    return 0


def _print_table(args: argparse.Namespace, batch: int, results: list[tuple[str, dict[str, Any]]],
                 padding: dict[str, Any]) -> None:
    grid = {"mobilenet_v2": "7x7x1280", "vgg19": "14x14x512"}[args.encoder]
    cfg = ("VGG-19 14x14x512, embed/attn 512, LSTM 1800" if args.paper else
           f"{args.encoder} {grid} (random weights), embed/attn/LSTM 512")
    mem = "peak GPU MB" if args.device.startswith("cuda") else "peak RSS MB"
    print(f"\nmachine: {_machine(args.device, args.threads)}")
    print(f"model: {cfg}, frozen encoder, {64 if args.tiny else 224} px, batch {batch}, device {args.device}, "
          f"precision {args.precision}; training: {args.steps} timed steps per row in "
          f"{args.rounds} interleaved rounds, each after {args.warmup} warm-up steps")
    head = f"| {'configuration':<42} | {'captions/s':>10} | {'step ms':>8} | {'data wait':>9} " \
           f"| {'padding':>7} | {mem:>11} | notes"
    print(head)
    print("|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|---")
    for name, r in results:
        wait = f"{100 * r['wait']:.1f}%" if "wait" in r else ""
        pad = f"{100 * r['padding']:.1f}%" if "padding" in r else ""
        print(f"| {name:<42} | {_fmt(r.get('captions_per_s'), '10.1f'):>10} | "
              f"{_fmt(r.get('step_ms'), '8.0f'):>8} | {wait:>9} | {pad:>7} | "
              f"{r['peak_mb']:11.0f} | {r.get('notes', '')}")
    by = dict(results)
    for att in ("soft", "hard"):
        c, u = by.get(f"train, cached, {att}"), by.get(f"train, uncached, {att}")
        if c and u:
            print(f"cached / uncached training, {att}: {c['captions_per_s'] / u['captions_per_s']:.1f}x")
    c, u = by.get("train, cached, soft"), by.get("train, uncached, soft, channels_last")
    if c and u:
        print(f"cached / uncached training, soft, CNN in channels_last: "
              f"{c['captions_per_s'] / u['captions_per_s']:.1f}x")
    c, k = by.get("train, cached, soft"), by.get("train, cached, soft, torch.compile")
    if c and k:
        print(f"torch.compile / eager (cached soft): {k['captions_per_s'] / c['captions_per_s']:.2f}x")
    for name, pad in padding.items():
        print(f"padding share of one epoch's (B, T) step-rows, {name} ({pad['captions']} "
              f"captions, batch {batch}): {100 * pad['bucketed']:.1f}% bucketed, "
              f"{100 * pad['random']:.1f}% random batches")


if __name__ == "__main__":
    sys.exit(main())
