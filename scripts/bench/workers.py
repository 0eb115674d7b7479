"""The benchmark's workers: each takes a spec (a plain dict, the same across revisions for
`--against`) and returns one measurement."""

from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.probes import (
    flop_counter,
    matmul_rate,
    onednn_flop_formulas,
    peak_memory_mb,
    profiler,
    python_profiler,
    step_timer,
)


def never_end(decoder: Any) -> None:
    """Make `decoder` never emit <end> (its output bias to -1e4), so that every caption runs to
    the length limit: an untrained decoder would otherwise stop at once."""
    import torch

    from captioning.models.decoding import SpecialIds

    with torch.no_grad():
        decoder.out.bias[SpecialIds().end] = -1e4


def build_run(spec: dict[str, Any], *, cached: bool) -> tuple[Any, Any]:
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
        net.update(backbone=spec["encoder"], grid_size=spec.get("grid_size"), embed_dim=dims,
                   hidden_dim=dims, attn_dim=dims, dropout=0.5)
    data: dict[str, Any] = {
        "image_size": spec["image_size"], "batch_size": spec["batch_size"],
        "eval_batch_size": spec["batch_size"], "num_workers": spec["num_workers"],
        "pin_memory": spec["device"].startswith("cuda"),
        "persistent_workers": spec["num_workers"] > 0,
        "length_bucketing": spec.get("bucketing", True), "feature_cache": cached,
        "cache_dir": spec["cache_dir"], "validate_images": False, "vocab_path": None,
        "cache_verify": spec.get("cache_verify", "full")}
    if spec.get("group_by_image"):  # only when asked: older revisions (--against) lack it
        data["group_by_image"] = True
    if spec.get("features_on_device"):  # the same
        data["features_on_device"] = True
    if karpathy:
        data.update({"source.split_file": spec["split_file"],
                     "source.image_root": spec["image_root"]})
    else:
        data.update({"source.root": spec["root"], "min_word_count": 1,
                     **{f"source.{k}": v for k, v in spec["shapes"].items()}})
    model = {"compute_metrics": False, "fast_path": spec.get("fast_path", "off"),
             "decode.beam_size": spec.get("beam_size", 3),
             "decode.max_len": spec.get("max_len", 20),
             **{f"net.{k}": v for k, v in net.items()}, **spec.get("model", {})}
    for group, values in (("model", model), ("data", data)):
        for k, v in values.items():
            args += [f"--{group}.{k}", "null" if v is None else str(v)]
    cli = lightning_cli([*args, "--trainer.logger", "false"], run=False)
    return cli.model, cli.datamodule


def attach_cache(module: Any, dm: Any, device: str) -> None:
    """The feature cache, through `fit`'s one attach path."""
    from captioning.data.serving import attach_feature_cache

    captioner = module.captioner
    attach_feature_cache(dm, captioner.encoder, captioner.feature_cache_key(), device=device)


def worker_train(spec: dict[str, Any]) -> dict[str, Any]:
    """Train `warmup + steps` steps through Lightning; time the last `steps`. Optional spec
    keys: `devices` (> 1: DDP), `sample_gpu` (mean GPU utilisation over the timed steps),
    `count_flops` (FLOPs of the timed steps), `profile` (top ops of the timed steps),
    `python_profile` (cProfile's self time of the timed steps, by source file)."""
    import lightning.pytorch as L
    import torch

    L.seed_everything(0, verbose=False)
    device = spec["device"]
    cuda = device.startswith("cuda")
    module, dm = build_run(spec, cached=spec["cached"])
    notes: list[str] = []
    if spec["cached"]:  # build (or find) the cache before timing anything
        t0 = time.perf_counter()
        attach_cache(module, dm, device)
        n = len(dm.cache_features(["train", "val"])["train"])
        notes.append(f"cache of {n} train images: {time.perf_counter() - t0:.0f} s")
    timer = step_timer(spec)
    probes = ([flop_counter(spec["warmup"])] if spec.get("count_flops") else []) + \
        ([profiler(spec)] if spec.get("profile") else []) + \
        ([python_profiler(spec)] if spec.get("python_profile") else [])
    devices = int(spec.get("devices", 1))
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=devices,
                        strategy="ddp" if devices > 1 else "auto", precision=spec["precision"],
                        max_steps=spec["warmup"] + spec["steps"], limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer, *probes], default_root_dir=spec["workdir"],
                        gradient_clip_val=5.0)
    trainer.fit(module, datamodule=dm)
    if spec.get("fast_path", "off") in ("compile", "graphs"):
        notes.append(f"{spec['warmup']} warm-up steps incl. compiling: {timer.first_steps:.0f} s")
    if spec.get("save_weights"):
        torch.save(module.state_dict(), spec["save_weights"])
    out = {"steps": timer.steps, "waits": timer.waits, "sizes": timer.sizes,
           "rows": timer.rows, "real": timer.real, "peak_mb": peak_memory_mb(device),
           "notes": "; ".join(notes), "vocab": dm.vocab_size, "gpu_util": timer.utilisation,
           "periods": timer.periods, "gpu_waits": timer.gpu_waits,
           "world_size": trainer.world_size}
    for probe in probes:
        out.update(probe.result())
    return out


def worker_roofline(spec: dict[str, Any]) -> dict[str, Any]:
    """The matmul rate (square, by torch.mm and, on a CPU, by oneDNN; and at the decoder's
    per-word LSTM product), then the FLOPs of the timed steps of one cached training round."""
    import torch

    n = spec["matmul_size"]
    square = matmul_rate(n, n, n, device=spec["device"])
    onednn = (matmul_rate(n, n, n, onednn=True)["best"] if spec["device"] == "cpu"
              and onednn_flop_formulas() and torch.backends.mkldnn.is_available() else None)
    # The LSTM gates from [ẑ_t, h_{t-1}]: (batch, D + H) x (D + H, 4H), read off the model.
    decoder = build_run(spec, cached=True)[0].captioner.decoder
    lstm = decoder.lstm
    step_shape = (spec["batch_size"], lstm.input_size - decoder.embed.embedding_dim
                  + lstm.hidden_size, 4 * lstm.hidden_size)
    step = matmul_rate(*step_shape, repeats=100, device=spec["device"])
    # A bf16 run's products run at the bf16 rate: measure it too (AVX512-BF16 or AMX on a CPU)
    low = (matmul_rate(n, n, n, device=spec["device"], dtype="bfloat16")["best"]
           if spec["precision"].startswith("bf16") else None)
    counted = worker_train({**spec, "count_flops": True})
    return {"matmul_gflops": square["best"], "matmul_gflops_median": square["median"],
            "onednn_matmul_gflops": onednn, "bf16_matmul_gflops": low,
            "matmul_size": n, "threads": torch.get_num_threads(), "step_shape": step_shape,
            "step_matmul_gflops": step["best"],
            **{k: counted[k] for k in ("flops", "flop_pairs", "flop_words")}}


def worker_profile(spec: dict[str, Any]) -> dict[str, Any]:
    """Top ops by self CPU time over the timed steps of a cached training run."""
    return worker_train({**spec, "profile": True})


def worker_beam(spec: dict[str, Any]) -> dict[str, Any]:
    """Beam search on the cached val features (repeated up to `beam_images`), every caption
    `max_len` steps, at each `settings` ([[beam, batch], ...] or [[beam, batch, fast_beam],
    ...]: `Captioner.use_fast_beam`, default off; default: `beam_size` and `batch_size`) in
    turn, in this one process: `{"rows": [result per setting]}`. A fast beam's row counts the
    images whose best caption is the one `off` gave at its beam and batch (`same`), where an
    `off` row came before it. With `rows_file`, each row is also appended there as a JSON line
    when it is measured: a worker killed at a deadline leaves the rows it finished."""
    import torch

    module, feats = beam_setup(spec)
    device = feats.device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=spec["precision"] == "bf16-mixed")
    best: dict[tuple[int, int], Any] = {}  # off's best captions at each (beam, batch)

    def run(b: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(0, len(feats), b):
            module.generate(feats[s: s + b])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def measure(beam: int, b: int, fast_beam: str = "off") -> dict[str, Any]:
        module.decode = replace(module.decode, beam_size=beam)
        module.captioner.use_fast_beam(fast_beam)  # type: ignore[arg-type]
        with torch.inference_mode(), autocast:
            module.generate(feats[:b])  # warm-up
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            dt = statistics.median(run(b) for _ in range(3))
            peak = peak_memory_mb(spec["device"])
            captions = best_captions(module, feats, b)
        row = {"captions_per_s": len(feats) / dt, "step_ms": 1e3 * dt / -(-len(feats) // b),
               "peak_mb": peak, "notes": f"beam {beam}, {spec['max_len']} steps, batch {b}, "
                                         f"{len(feats)} images, fast_beam {fast_beam}"}
        if fast_beam == "off":
            best[(beam, b)] = captions
        elif (beam, b) in best:
            row["same"] = same_captions(captions, best[(beam, b)])
            row["notes"] += f"; {row['same']}/{len(feats)} best captions as off's"
        return row

    def measured(setting: list[Any]) -> dict[str, Any]:
        try:
            row = measure(*setting)
        except Exception as e:  # one setting's failure (a graph's capture, say) is its row's
            row = {"error": f"{type(e).__name__}: {e}"[:300]}
        if spec.get("rows_file"):
            with open(spec["rows_file"], "a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    settings = spec.get("settings") or [[spec["beam_size"], spec["batch_size"]]]
    return {"rows": [measured(setting) for setting in settings]}


def beam_setup(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The beam worker's module (its saved `weights` where given; <end> disabled), in eval
    mode on the device, and `beam_images` cached val grids there."""
    import lightning.pytorch as L
    import torch

    L.seed_everything(0, verbose=False)
    module, dm = build_run({**spec, "features_on_device": False}, cached=True)  # grids, here
    attach_cache(module, dm, spec["device"])
    if spec.get("weights") and Path(spec["weights"]).exists():
        module.load_state_dict(torch.load(spec["weights"], map_location="cpu"))
    never_end(module.captioner.decoder)
    module.to(spec["device"]).eval()
    ds = dm.dataset_for("val")
    feats = torch.stack([ds[i % len(ds)][0] for i in range(spec["beam_images"])])
    return module, feats.to(spec["device"])


def best_captions(module: Any, feats: Any, b: int) -> list[Any]:
    """Each batch's `Generation` of its images' best captions, by `module.generate` in batches
    of `b`."""
    return [module.generate(feats[s: s + b]).first_per_image() for s in range(0, len(feats), b)]


def same_captions(a: list[Any], b: list[Any]) -> int:
    """How many rows of two runs' `Generation`s got the same words."""
    def rows(gens: list[Any]) -> list[list[int]]:
        return [t[:n] for g in gens for t, n in zip(g.tokens.tolist(), g.lengths.tolist())]

    return sum(x == y for x, y in zip(rows(a), rows(b)))


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

    _, dm = build_run({**spec, "attention": "soft"}, cached=False)
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
           "padding": worker_padding, "roofline": worker_roofline, "profile": worker_profile}
