"""Training-speed benchmark. Prints one table.

    python scripts/benchmark.py                      # CPU: paper-size decoder, mobilenet_v2
    python scripts/benchmark.py --encoder vgg19      # CPU: paper-size decoder, the paper's CNN
    python scripts/benchmark.py --device cuda --precision bf16-mixed --paper
    python scripts/benchmark.py --preset issue17       # CPU: issue 17's setting, with the roofline
    python scripts/benchmark.py --roofline --profile   # + machine roofline, top ops of a profile
    python scripts/benchmark.py --preset issue17 --against 361b9f1   # before / after, one run

Rows (each measured in fresh subprocesses, so that peak memory is per row; the training rows
in `--rounds` interleaved rounds, so that a busy spell of a shared machine is spread over all
of them):

* training captions/s through the real `CaptionDataModule` + `CaptioningModule` + Lightning
  `Trainer`, with the encoder's features cached (the CNN never runs) or not (the frozen CNN
  runs on every batch), soft and hard attention; cached soft also without length bucketing,
  with batches that hold each image's captions together (`group_by_image`: the keys projected
  once per image) and with the decoder's fast path (`fast_path: compile`, `graphs` on CUDA).
  On the CPU the rows train with the default `fast_path: auto` (the native score kernel);
  `aten` adds the cached soft row with `fast_path: off` (the score by ATen operations);
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

`--roofline` adds, after the table: the machine's fp32 matmul rate (a `--matmul-size` square
product, best of 5, with the benchmark's thread count: the faster of `torch.mm`, which runs by
MKL on a CPU, and oneDNN's linear, both printed); the FLOPs per training pair of cached soft
training (forward, backward and optimiser, counted by `torch.utils.flop_counter.FlopCounterMode`,
which counts matmul-class ops only, oneDNN's linear and the native kernels added as the ATen
ops they replace (`flop_formulas`), over the very batches that a timing round times: every
round starts from the same seed); and the achieved GFLOP/s of the cached soft row (FLOPs per
pair x its mean pairs/s), with its share of the matmul rate. `--profile`
runs `torch.profiler` over `--profile-steps` cached soft training steps (and by image, with the
`grouped` row) and prints the top ops by self CPU time. `--preset NAME` sets a named setting
(`PRESETS`); flags given on the command line win.

`--against REV [REV ...]` adds the cached soft row once more per revision (and the by-image
row, when asked for and the revision has it), run by the project's code at that git revision
(exported with `git archive`; its benchmark.py must read the same worker spec), in the same
interleaved rounds: a before and after on one machine in one run.
On CUDA every row then syncs around each step, as revisions before the GPU-timeline timer did.

On CUDA a step's time is its span on the GPU timeline (CUDA events, no sync per step: the
previous step's end to its own, the wait before it included), and "data wait" is the share of
that time the GPU itself waited between steps; the host's wait goes to --json (`host_wait`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from itertools import pairwise, product
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
                       captions: int = COCO_CAPTIONS,
                       filenames: list[str] | dict[str, list[str]] | None = None,
                       filepath: str = "", seed: int = 0) -> Path:
    """Write a Karpathy split file shaped like dataset_coco.json.

    Captions are 5 per image (a few get 6 or 7, up to `captions`), 8 to 25 words (mean ~10.5,
    like COCO), drawn from a Zipf-distributed 30k-word vocabulary (about 10k words occur 5
    times or more). `filenames` cycles through existing images: one list for every image, or
    one list per split (an image file may be in one split only); default: names that need
    not exist.
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
    start = dict(zip(splits, np.cumsum([0, *splits.values()])))  # first image of each split
    images, sent, cap = [], 0, 0
    for i in range(n_images):
        sentences = []
        for _ in range(per_image[i]):
            tokens = [words[w] for w in flat[offsets[cap]: offsets[cap + 1]]]
            sentences.append({"tokens": tokens, "raw": " ".join(tokens).capitalize() + ".",
                              "imgid": i, "sentid": sent})
            sent += 1
            cap += 1
        split = str(split_of[i])
        if isinstance(filenames, dict):  # cycled within the split
            name = filenames[split][(i - start[split]) % len(filenames[split])]
        else:
            name = filenames[i % len(filenames)] if filenames else \
                f"COCO_{split}2014_{i:012d}.jpg"
        images.append({"filepath": filepath, "sentids": [s["sentid"] for s in sentences],
                       "filename": name, "imgid": i, "split": split,
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
    from captioning.data.features import attach_feature_cache

    captioner = module.captioner
    attach_feature_cache(dm, captioner.encoder, captioner.feature_cache_key(), device=device)


def worker_train(spec: dict[str, Any]) -> dict[str, Any]:
    """Train `warmup + steps` steps through Lightning; time the last `steps`. Optional spec
    keys: `devices` (> 1: DDP), `sample_gpu` (mean GPU utilisation over the timed steps),
    `count_flops` (FLOPs of the timed steps), `profile` (top ops of the timed steps)."""
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
    timer = _step_timer(spec)
    probes = ([_flop_counter(spec["warmup"])] if spec.get("count_flops") else []) + \
        ([_profiler(spec)] if spec.get("profile") else [])
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
           "rows": timer.rows, "real": timer.real, "peak_mb": _peak_memory_mb(device),
           "notes": "; ".join(notes), "vocab": dm.vocab_size, "gpu_util": timer.utilisation,
           "periods": timer.periods, "gpu_waits": timer.gpu_waits,
           "world_size": trainer.world_size}
    for probe in probes:
        out.update(probe.result())
    return out


def _step_timer(spec: dict[str, Any]) -> Any:
    """A callback timing each step after `spec["warmup"]` (batch start to end: forward,
    backward, optimiser) and the wait before it; with `sample_gpu`, also sampling the GPU's
    utilisation over the timed steps.

    On the CPU each step is timed alone. On CUDA the host runs ahead of the GPU, as training
    does; a sync around each step would stop it preparing the next step while the GPU works.
    There CUDA events are recorded at each step's start and end, without a sync. A step's
    time (`periods`) is the GPU-timeline span from the previous step's end event to its own:
    the rate at which steps go through, whether the host or the GPU bounds it. `gpu_waits`
    are what the GPU itself waited before each step: from the previous end event to the
    step's start event (the batch's copy, the loader and the loop's host work between steps),
    zero when the host is ahead. `waits` stay host times, which count that host work whether
    or not the GPU was busy meanwhile. `sync_steps` syncs around every step instead (the older
    measure)."""
    import lightning.pytorch as L
    import torch

    cuda = spec["device"].startswith("cuda")
    each = not cuda or spec.get("sync_steps", False)  # sync (on CUDA) around every step

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.i, self.last_end, self.t_start, self.first_steps = 0, 0.0, 0.0, 0.0
            self.steps: list[float] = []
            self.waits: list[float] = []
            self.sizes: list[int] = []
            self.rows = self.real = 0
            self.sampler = GpuUtilisation() if cuda and spec.get("sample_gpu") else None
            self.utilisation: float | None = None
            self.words: list[Any] = []  # each timed batch's words per caption
            self.events: list[Any] = []
            self.end_events: list[Any] = []
            self.periods: list[float] | None = None
            self.gpu_waits: list[float] | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.last_end = time.perf_counter()  # the first wait, with no warm-up step
            if not each and spec["warmup"] == 0:
                self._record(self.end_events)

        def _record(self, events: list[Any]) -> None:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()

        def _now(self) -> float:
            if cuda and each:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            self.t_start = self._now()
            if self.i >= spec["warmup"]:
                self.waits.append(self.t_start - self.last_end)
                if not each:
                    self._record(self.events)
            if self.i == spec["warmup"] and cuda:
                torch.cuda.reset_peak_memory_stats()
                if self.sampler:
                    self.sampler.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.last_end = self._now()
            if self.i < spec["warmup"]:
                self.first_steps += self.last_end - self.t_start
            else:
                self.steps.append(self.last_end - self.t_start)
                self.words.append((batch.lengths - 1).clamp_min(0))  # read at the end: no sync
                self.sizes.append(len(batch.lengths))
            if not each and self.i >= spec["warmup"] - 1:  # from the last warm-up step's end
                self._record(self.end_events)
            self.i += 1

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if not each and len(self.end_events) > 1:  # the timed steps the run got through
                self.end_events[-1].synchronize()
                n = min(len(self.events), len(self.end_events) - 1)
                ends = self.end_events[: n + 1]  # ends[k]: the end before timed step k
                # A period is end to end, the wait before the step included (as host steps
                # and waits are counted); the GPU's wait is the previous end to this start.
                self.periods = [a.elapsed_time(b) / 1e3 for a, b in pairwise(ends)]
                self.gpu_waits = [a.elapsed_time(b) / 1e3 for a, b in zip(ends, self.events)]
            if self.sampler:
                self.utilisation = self.sampler.stop()
            for words in self.words:  # padded (B, T) step-rows and the real ones
                self.rows += int(words.max()) * len(words)
                self.real += int(words.sum())

    return StepTimer()


class GpuUtilisation:
    """Mean utilisation (%) of the current GPU between `start` and `stop`, sampled by a thread
    every `interval` s: `torch.cuda.utilization()` (needs pynvml), else `nvidia-smi`."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._stop: Any = None
        self._thread: Any = None

    def read(self) -> float | None:
        import torch

        try:
            return float(torch.cuda.utilization())
        except Exception:  # no pynvml, or NVML refuses: ask nvidia-smi
            pass
        try:
            uuid = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
            out = subprocess.run(["nvidia-smi", f"--id={uuid}", "--query-gpu=utilization.gpu",
                                  "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5)
            return float(out.stdout.strip().splitlines()[0])
        except (OSError, ValueError, IndexError, AttributeError, subprocess.SubprocessError):
            return None

    def start(self) -> None:
        import threading

        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.wait(self.interval):
                value = self.read()
                if value is None:
                    return
                self.samples.append(value)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        return statistics.mean(self.samples) if self.samples else None


def _onednn_flops(x_shape: Any, second: Any, third: Any = None, *args: Any,
                  **kwargs: Any) -> int:
    """oneDNN's linear x (..., K) by a weight (N, K): 2·(rows)·K·N (the decoder's native path
    runs its per-word recurrent product so). `_linear_pointwise(x, weight, bias, ...)` or
    `.binary(x, other, weight, bias, ...)`: the weight is the 2-d shape after x's other."""
    binary = third is not None and len(third) == 2
    return 2 * math.prod(x_shape) * (third if binary else second)[0]


def onednn_flop_formulas() -> dict[Any, Any]:
    """`FlopCounterMode`'s `custom_mapping` for oneDNN's linear, which it does not count."""
    import torch

    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return {}
    return {torch.ops.mkldnn._linear_pointwise: _onednn_flops}  # both overloads


def flop_formulas() -> dict[Any, Any]:
    """`custom_mapping` for the products `FlopCounterMode` does not see: oneDNN's linear and
    the loaded native kernels (`native.flop_formulas`), each counted as the ATen operations it
    replaces; so a CPU pass counts the same on the native path as with `fast_path: off`."""
    from captioning.models import native

    return {**onednn_flop_formulas(), **native.flop_formulas()}


def _flop_counter(warmup: int) -> Any:
    """A callback counting the FLOPs of every step after `warmup` (forward, backward and
    optimiser; `FlopCounterMode` counts matmul-class ops, and `flop_formulas` those it does
    not see), and the pairs and words trained."""
    import lightning.pytorch as L
    from torch.utils.flop_counter import FlopCounterMode

    class FlopCount(L.Callback):
        def __init__(self) -> None:
            self.i = self.flops = self.pairs = self.words = 0
            self.mode: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            if self.i >= warmup:
                # made here, after the model has loaded the native kernels
                self.mode = FlopCounterMode(display=False, custom_mapping=flop_formulas())
                self.mode.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                self.flops += int(self.mode.get_total_flops())
                self.pairs += len(batch.lengths)
                self.words += int((batch.lengths - 1).clamp_min(0).sum())
                self.mode = None
            self.i += 1

        def result(self) -> dict[str, Any]:
            return {"flops": self.flops, "flop_pairs": self.pairs, "flop_words": self.words}

    return FlopCount()


def _profiler(spec: dict[str, Any]) -> Any:
    """A callback profiling the steps after `spec["warmup"]` with `torch.profiler`; `result`
    gives the top ops by self CPU time, per step."""
    import lightning.pytorch as L
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if spec["device"].startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)

    class Profile(L.Callback):
        def __init__(self) -> None:
            self.i, self.prof = 0, profile(activities=activities)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            if self.i == spec["warmup"]:
                self.prof.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.i += 1
            if self.i == spec["warmup"] + spec["steps"]:
                if spec["device"].startswith("cuda"):
                    torch.cuda.synchronize()
                self.prof.stop()

        def result(self) -> dict[str, Any]:
            return {"profile": top_ops(self.prof.key_averages(), spec["steps"])}

    return Profile()


def top_ops(events: Any, steps: int, n: int = 15) -> list[dict[str, Any]]:
    """The `n` ops of a profile (`key_averages()`) with the most self CPU time: ms per step,
    share of all self CPU time, calls per step (and self CUDA ms per step when recorded)."""
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    rows = []
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:n]:
        cuda_us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        rows.append({"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3 / steps,
                     "share": e.self_cpu_time_total / total, "calls": e.count / steps,
                     "self_cuda_ms": cuda_us / 1e3 / steps})
    return rows


def matmul_rate(m: int, k: int, p: int, *, repeats: int = 5, device: str = "cpu",
                dtype: str = "float32", onednn: bool = False) -> dict[str, float]:
    """GFLOP/s of an (m, k) x (k, p) `torch.mm` (2 m k p FLOPs) in `dtype` (fp32 by default),
    or with `onednn` of oneDNN's linear (a CPU's float32 products run by MKL otherwise): best
    and median of `repeats` after a warm-up."""
    import torch

    kw = {"device": device, "dtype": getattr(torch, dtype)}
    a, b = torch.randn(m, k, **kw), torch.randn(k, p, **kw)
    weight = b.t().contiguous()  # (p, k), as oneDNN's linear takes it

    def product() -> Any:
        if onednn:
            return torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], "")
        return torch.mm(a, b)

    product()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        product()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    flop = 2 * m * k * p
    return {"best": flop / min(times) / 1e9, "median": flop / statistics.median(times) / 1e9}


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


def summarize_train(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the timed steps of every round: medians (robust to other processes on a shared
    machine) and means. A step's time is its host time plus the wait before it, or its
    GPU-timeline period where the round has `periods` (CUDA without per-step syncs); there
    `step_ms` is the period too. `wait` is the share of time the GPU waited between steps where
    every round has `gpu_waits` (its total over the periods' total: a few long waits count in
    full), else the host's wait, as `host_wait` always is (medians)."""
    def totals(r: dict[str, Any]) -> list[float]:
        return r.get("periods") or [a + b for a, b in zip(r["steps"], r["waits"])]

    total = [x for r in rounds for x in totals(r)]
    waits = [x for r in rounds for x in r["waits"]]
    sizes = [x for r in rounds for x in r["sizes"]]
    # A GPU-timeline period overlaps the host's wait: it is the step's time as it stands.
    steps = [x for r in rounds for x in (r.get("periods") or r["steps"])]
    host_wait = statistics.median(waits) / statistics.median(total)
    gpu = all(r.get("gpu_waits") for r in rounds)
    gpu_waits = [x for r in rounds for x in r.get("gpu_waits") or []]
    return {"captions_per_s": statistics.median(n / t for n, t in zip(sizes, total)),
            "step_ms": 1e3 * statistics.median(steps),
            "wait": sum(gpu_waits) / sum(total) if gpu else host_wait, "host_wait": host_wait,
            "wait_on": "gpu" if gpu else "host",
            "mean_captions_per_s": sum(sizes) / sum(total), "mean_wait": sum(waits) / sum(total),
            "padding": 1 - sum(r["real"] for r in rounds) / max(1, sum(r["rows"] for r in rounds)),
            "peak_mb": max(r["peak_mb"] for r in rounds), "timed_steps": len(steps),
            "per_round_captions_per_s": [sum(r["sizes"]) / sum(totals(r)) for r in rounds],
            "notes": rounds[0]["notes"]}


def worker_beam(spec: dict[str, Any]) -> dict[str, Any]:
    """Beam search on the cached val features (repeated up to `beam_images`), every caption
    `max_len` steps, at each `settings` ([[beam, batch], ...]; default: `beam_size` and
    `batch_size`) in turn, in this one process: `{"rows": [result per setting]}`."""
    import lightning.pytorch as L
    import torch

    from captioning.models.decoding import SpecialIds

    L.seed_everything(0, verbose=False)
    device = torch.device(spec["device"])
    module, dm = build_run(spec, cached=True)
    attach_cache(module, dm, spec["device"])
    if spec.get("weights") and Path(spec["weights"]).exists():
        module.load_state_dict(torch.load(spec["weights"], map_location="cpu"))
    with torch.no_grad():
        module.captioner.decoder.out.bias[SpecialIds().end] = -1e4
    module.to(device).eval()
    ds = dm.dataset_for("val")
    n = spec["beam_images"]
    feats = torch.stack([ds[i % len(ds)][0] for i in range(n)]).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=spec["precision"] == "bf16-mixed")

    def run(b: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(0, len(feats), b):
            module.generate(feats[s: s + b])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def measure(beam: int, b: int) -> dict[str, Any]:
        module.decode = replace(module.decode, beam_size=beam)
        with torch.inference_mode(), autocast:
            module.generate(feats[:b])  # warm-up
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            dt = statistics.median(run(b) for _ in range(3))
        return {"captions_per_s": len(feats) / dt, "step_ms": 1e3 * dt / -(-len(feats) // b),
                "peak_mb": _peak_memory_mb(spec["device"]),
                "notes": f"beam {beam}, {spec['max_len']} steps, batch {b}, "
                         f"{len(feats)} images"}

    settings = spec.get("settings") or [[spec["beam_size"], spec["batch_size"]]]
    return {"rows": [measure(beam, b) for beam, b in settings]}


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


def start_worker(spec: dict[str, Any], threads: int | None) -> subprocess.Popen[str]:
    """A worker in a fresh process (`finish_worker` waits for its result). `threads`: its
    intra-op threads (OMP_NUM_THREADS). With `spec["code"]` (a `--against` export) the worker
    is that revision's benchmark.py, importing that revision's package."""
    from captioning.launch import fresh_launch_env

    env = fresh_launch_env(os.environ)  # a DDP worker sets up its own ranks
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    script = __file__
    if spec.get("code"):
        script = str(Path(spec["code"]) / "scripts" / "benchmark.py")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [spec["code"], env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, script, "--worker", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own group: a timeout stops its ranks


def export_revision(rev: str, dest: Path) -> Path:
    """The project's package and scripts at git revision `rev`, written under `dest`."""
    root = Path(__file__).resolve().parent.parent
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", f"{rev}^{{commit}}"],
                         capture_output=True, text=True, check=True).stdout.strip()
    out = dest / f"rev-{sha}"
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", sha,
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


# ---------------------------------------------------------------------------------------------
# Orchestration


def describe_machine(device: str, threads: int | None) -> str:
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


# Named settings: `--preset NAME` makes these the defaults (flags on the command line win).
PRESETS: dict[str, dict[str, Any]] = {
    # Issue 17's CPU setting: resnet18 frozen at 256 px (an 8x8 grid, pooled to 14x14 by
    # `net.grid_size: 14`), decoder 512/512/512, batch 32, 2 threads, 1,500 training images x
    # 5 captions; cached soft training, bucketed and by image, with the roofline.
    "issue17": {"encoder": "resnet18", "image_size": 256, "grid_size": 14, "batch_size": 32,
                "threads": 2, "num_train": 1500, "rows": "cached,grouped", "attentions": "soft",
                "roofline": True},
}
ENCODERS = ("mobilenet_v2", "vgg19", "resnet18")
GROUPED = "train, cached, soft, by image"  # the row of `CaptionDataModule(group_by_image=True)`


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named setting (PRESETS); explicit flags win")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    p.add_argument("--paper", action="store_true",
                   help="COCO paper configuration: VGG-19 14x14x512, LSTM 1800, batch 64, "
                        "10k-word synthetic COCO captions")
    p.add_argument("--encoder", default="mobilenet_v2", choices=ENCODERS,
                   help="frozen CNN without --paper (default mobilenet_v2)")
    p.add_argument("--image-size", type=int, default=None, help="default 224 (64 with --tiny)")
    p.add_argument("--grid-size", type=int, default=None,
                   help="pool the CNN's grid to this many cells a side (default: the CNN's own)")
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
    p.add_argument("--rows", default="uncached,cached,channels_last,nobucket,grouped,compile,"
                                     "beam,coco",
                   help="comma-separated subset of: uncached,cached,channels_last,nobucket,"
                        "grouped (batches by image),aten (fast_path off),compile,beam,coco")
    p.add_argument("--attentions", default="soft,hard",
                   help="attention kinds of the uncached and cached rows")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per run (default: torch's); use 1 on a machine "
                        "shared with other jobs, where OpenMP thread teams stall")
    p.add_argument("--roofline", action="store_true",
                   help="also: matmul rate, FLOPs per pair and achieved GFLOP/s of cached soft "
                        "training (adds the cached soft row)")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="n of the roofline's n x n matmul (default 4096; 512 with --tiny)")
    p.add_argument("--profile", action="store_true",
                   help="also: torch.profiler over cached soft training, top ops by self CPU time")
    p.add_argument("--profile-steps", type=int, default=5, help="profiled steps")
    p.add_argument("--against", nargs="+", default=[], metavar="REV",
                   help="also run the cached soft row with the code at these git revisions")
    p.add_argument("--workdir", default=None, help="keep files here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--tiny", action="store_true",
                   help="64 px images and a 32-unit decoder: checks that every row runs")
    known, _ = p.parse_known_args(argv)
    if known.preset:
        p.set_defaults(**PRESETS[known.preset])
    args = p.parse_args(argv)
    args.warmup = max(1, args.warmup)  # the first timed step needs a previous step's end
    args.image_size = args.image_size or (64 if args.tiny else 224)
    args.batch_size = args.batch_size or (64 if args.paper else 32)
    args.matmul_size = args.matmul_size or (512 if args.tiny else 4096)
    return args


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


def make_base(work: Path, *, device: str = "cpu", precision: str = "32-true",
              paper: bool = False, encoder: str = "mobilenet_v2", batch_size: int = 32,
              num_train: int = 640, num_val: int = 64, image_size: int = 224,
              grid_size: int | None = None, tiny: bool = False, channels_last: bool = False,
              steps: int = 24, warmup: int = 2, threads: int | None = None) -> dict[str, Any]:
    """Generate the shapes data under `work` (and, with `paper`, COCO-like captions over its
    images) and return the spec every worker starts from."""
    from captioning.data.shapes import generate_shapes

    shapes = {"num_train": num_train, "num_val": num_val, "num_test": 0,
              "image_size": image_size, "seed": 0}
    t0 = time.perf_counter()
    root = generate_shapes(work / "shapes", **shapes)
    log.info("shapes data ready in %.0f s", time.perf_counter() - t0)
    base = {"device": device, "precision": precision, "paper": paper, "encoder": encoder,
            "grid_size": grid_size, "batch_size": batch_size, "root": str(root),
            "shapes": shapes, "image_size": image_size, "tiny": tiny,
            "cache_dir": str(work / "features"), "workdir": str(work),
            "channels_last": channels_last, "steps": steps, "warmup": warmup,
            # the CPU's default (`auto`: the native score kernel; older revisions: off); the
            # GPU rows run eagerly, the compiled passes have rows of their own
            "fast_path": "auto" if device == "cpu" else "off", "threads": threads}
    if paper:  # COCO-like captions (10k words) over the shapes images
        names = {split: sorted(p.name for p in (root / "images").glob(f"{split}_*.png"))
                 for split in ("train", "val")}
        split_file = make_coco_karpathy(
            work / "paper_captions.json", filenames=names,
            splits={"train": 20_000, "val": num_val}, captions=0)  # 100k captions
        base.update(split_file=str(split_file), image_root=str(root / "images"))
    return base


def train_configs(args: argparse.Namespace, weights: str,
                  against: dict[str, str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(row name, spec overrides) of the training rows that `args` asks for; `against`: the
    exported code of each `--against` revision."""
    rows = set(args.rows.split(","))
    attentions = args.attentions.split(",")
    if args.roofline:  # it reads the cached soft row's rate
        rows.add("cached")
        attentions = list(dict.fromkeys(["soft", *attentions]))
    configs: list[tuple[str, dict[str, Any]]] = []
    for attention in attentions:
        if "uncached" in rows:
            configs.append((f"train, uncached, {attention}",
                            {"cached": False, "attention": attention}))
        if "cached" in rows:
            configs.append((f"train, cached, {attention}", {
                "attention": attention,
                "save_weights": weights if attention == "soft" else None}))
    for rev, code in (against or {}).items():
        configs.append((f"train, cached, soft, code at {rev}", {"code": code}))
    if "channels_last" in rows:
        configs.append(("train, uncached, soft, channels_last",
                        {"cached": False, "channels_last": True}))
    if "nobucket" in rows:
        configs.append(("train, cached, soft, no bucketing", {"bucketing": False}))
    if "grouped" in rows:  # an image's captions in one batch: its keys projected once
        configs.append((GROUPED, {"group_by_image": True}))
        for rev, code in (against or {}).items():  # revisions that have batches by image
            module = Path(code) / "captioning" / "data" / "datamodule.py"
            if "group_by_image" in module.read_text():
                configs.append((f"{GROUPED}, code at {rev}", {"code": code,
                                                              "group_by_image": True}))
        if "uncached" in rows:  # and the frozen CNN runs once per image
            configs.append(("train, uncached, soft, by image",
                            {"cached": False, "group_by_image": True}))
    if "aten" in rows:  # the score by ATen operations, without the native CPU kernel
        configs.append(("train, cached, soft, fast_path off", {"fast_path": "off"}))
    if "compile" in rows:  # the fixed-shape pass: compiled, and replayed as CUDA graphs
        configs.append(("train, cached, soft, fast_path compile",
                        {"fast_path": "compile", "warmup": max(args.warmup, 3)}))
        if args.device.startswith("cuda"):
            configs.append(("train, cached, soft, fast_path graphs",
                            {"fast_path": "graphs", "warmup": max(args.warmup, 3)}))
    return configs


def train_spec(base: dict[str, Any], args: argparse.Namespace, kw: dict[str, Any],
               steps: int) -> dict[str, Any]:
    """The worker spec of one training row (`kw`: its overrides), `steps` timed steps."""
    cached = kw.get("cached", True)
    workers = args.num_workers if args.num_workers is not None else (
        4 if args.device.startswith("cuda") else (0 if cached else 2))
    return {**base, "kind": "train", "attention": "soft", "cached": True,
            "num_workers": workers, **kw, "steps": steps}


def run_training_rows(base: dict[str, Any], args: argparse.Namespace,
                      configs: list[tuple[str, dict[str, Any]]]
                      ) -> list[tuple[str, dict[str, Any]]]:
    """Interleaved rounds: every configuration runs a share of its steps in each round, so
    that a busy spell of the machine does not land on one configuration only."""
    per_round = -(-args.steps // args.rounds)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    for r in range(args.rounds):
        for name, kw in configs:
            log.info("round %d/%d: %s", r + 1, args.rounds, name)
            runs[name].append(run_worker(train_spec(base, args, kw, per_round), args.threads))
    results = []
    for name, kw in configs:
        res = summarize_train(runs[name])
        workers = train_spec(base, args, kw, 0)["num_workers"]
        res["notes"] = "; ".join(x for x in (f"{workers} loader workers", res["notes"]) if x)
        results.append((name, res))
    return results


def run_roofline(base: dict[str, Any], args: argparse.Namespace,
                 cached_soft: dict[str, Any], kw: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The roofline of cached soft training: matmul rate, FLOPs per pair (counted on the
    batches a timing round times, with the row's overrides `kw`) and the achieved rate of the
    `cached_soft` row."""
    log.info("running: roofline (matmul rate, FLOP count)")
    per_round = -(-args.steps // args.rounds)
    spec = {**train_spec(base, args, {"attention": "soft", **(kw or {})}, per_round),
            "kind": "roofline", "matmul_size": args.matmul_size}
    roof = run_worker(spec, args.threads)
    per_pair = roof["flops"] / max(1, roof["flop_pairs"])
    achieved = per_pair * cached_soft["mean_captions_per_s"] / 1e9
    # the machine's rate: the faster of torch.mm (MKL) and oneDNN, which the native path runs
    rate = max(roof["matmul_gflops"], roof.get("onednn_matmul_gflops") or 0.0)
    return {**roof, "flops_per_pair": per_pair,
            "words_per_pair": roof["flop_words"] / max(1, roof["flop_pairs"]),
            "pairs_per_s": cached_soft["mean_captions_per_s"], "achieved_gflops": achieved,
            "rate": rate, "share": achieved / rate,
            "bf16_share": achieved / roof["bf16_matmul_gflops"]
            if roof.get("bf16_matmul_gflops") else None}


def run_profile(base: dict[str, Any], args: argparse.Namespace,
                extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    log.info("running: profile of cached soft training%s", ", by image" if extra else "")
    spec = {**train_spec(base, args, {"attention": "soft", **(extra or {})},
                         args.profile_steps), "kind": "profile"}
    return run_worker(spec, args.threads)["profile"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_as_worker(json.loads(args.worker))

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = set(args.rows.split(","))
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="captioning-bench-") as tmp_dir:
        work = Path(args.workdir or tmp_dir)
        work.mkdir(parents=True, exist_ok=True)
        base = make_base(work, device=args.device, precision=args.precision, paper=args.paper,
                         encoder=args.encoder, batch_size=args.batch_size,
                         num_train=args.num_train, num_val=8 if args.tiny else 64,
                         image_size=args.image_size, grid_size=args.grid_size, tiny=args.tiny,
                         channels_last=args.channels_last, steps=args.steps,
                         warmup=args.warmup, threads=args.threads)
        if args.against and args.device.startswith("cuda"):
            base["sync_steps"] = True  # older revisions sync around each step: time all alike
        weights = str(work / "cached_soft.pt")
        against = {rev: str(export_revision(rev, work)) for rev in args.against}
        results = run_training_rows(base, args, train_configs(args, weights, against))
        if args.roofline:
            extra["roofline"] = run_roofline(base, args, dict(results)["train, cached, soft"])
            if GROUPED in dict(results):
                extra["roofline_grouped"] = run_roofline(base, args, dict(results)[GROUPED],
                                                         {"group_by_image": True})
        if args.profile:
            extra["profile"] = run_profile(base, args)
            if GROUPED in dict(results):
                extra["profile_grouped"] = run_profile(base, args, {"group_by_image": True})
        if "beam" in rows:
            log.info("running: beam search")
            res = run_worker({**base, "kind": "beam", "attention": "soft", "num_workers": 0,
                              "beam_size": args.beam_size, "max_len": args.max_len,
                              "beam_images": base["shapes"]["num_val"], "weights": weights},
                             args.threads)["rows"][0]
            results.append((f"beam search, cached, soft (beam {args.beam_size})", res))
        padding = run_padding_rows(base, args, work, results, coco="coco" in rows)

    _print_table(args, args.batch_size, results, padding)
    _print_roofline(args, extra.get("roofline"))
    _print_roofline(args, extra.get("roofline_grouped"), "by image")
    _print_profile(extra.get("profile"))
    _print_profile(extra.get("profile_grouped"), ", by image")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": describe_machine(args.device, args.threads), "args": vars(args),
            "rows": dict(results), "padding": padding, **extra}, indent=2))
    return 0


def run_padding_rows(base: dict[str, Any], args: argparse.Namespace, work: Path,
                     results: list[tuple[str, dict[str, Any]]], *, coco: bool
                     ) -> dict[str, Any]:
    """The padding shares (shapes; with `coco`, also the COCO-size index build row and the
    COCO-size padding share)."""
    padding: dict[str, Any] = {}
    if coco:
        log.info("writing a COCO-size Karpathy file")
        t0 = time.perf_counter()
        path = make_coco_karpathy(work / "coco" / "dataset_coco.json")
        log.info("  written in %.0f s (%.0f MB)", time.perf_counter() - t0,
                 path.stat().st_size / 2**20)
        log.info("running: COCO-size index build")
        spec = {"kind": "coco_index", "split_file": str(path), "image_root": str(path.parent)}
        results.append(("COCO-size index build (123k images)", run_worker(spec, args.threads)))
        padding["COCO-size"] = run_worker(
            {**base, "kind": "padding", "split_file": str(path),
             "image_root": str(path.parent), "num_workers": 0}, args.threads)
    padding["shapes"] = run_worker({**base, "kind": "padding", "num_workers": 0,
                                    "split_file": None}, args.threads)
    return padding


def grid_description(args: argparse.Namespace) -> str:
    """The annotation grid of the benchmark's CNN, e.g. 14x14x512."""
    from captioning.models.encoder import BACKBONES

    spec = BACKBONES["vgg19" if args.paper else args.encoder]
    n = 14 if args.paper else (args.grid_size or spec.side(args.image_size))
    return f"{n}x{n}x{spec.dim}"


def _print_table(args: argparse.Namespace, batch: int, results: list[tuple[str, dict[str, Any]]],
                 padding: dict[str, Any]) -> None:
    cfg = ("VGG-19 14x14x512, embed/attn 512, LSTM 1800" if args.paper else
           f"{args.encoder} {grid_description(args)} (random weights), embed/attn/LSTM "
           f"{32 if args.tiny else 512}")
    mem = "peak GPU MB" if args.device.startswith("cuda") else "peak RSS MB"
    print(f"\nmachine: {describe_machine(args.device, args.threads)}")
    print(f"model: {cfg}, frozen encoder, {args.image_size} px, batch {batch}, device "
          f"{args.device}, precision {args.precision}; training: {args.steps} timed steps per "
          f"row in {args.rounds} interleaved rounds, each after {args.warmup} warm-up steps"
          + (f"; preset {args.preset}" if args.preset else ""))
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
    for rev, (row, what) in product(args.against, (
            ("train, cached, soft", "cached soft training"), (GROUPED, "by image"))):
        c, k = by.get(row), by.get(f"{row}, code at {rev}")
        if c and k:
            print(f"{what}, this code / the code at {rev}: "
                  f"{c['captions_per_s'] / k['captions_per_s']:.2f}x (medians), "
                  f"{c['mean_captions_per_s'] / k['mean_captions_per_s']:.2f}x (means)")
    for mode in ("compile", "graphs"):
        c, k = by.get("train, cached, soft"), by.get(f"train, cached, soft, fast_path {mode}")
        if c and k:
            print(f"fast_path {mode} / eager (cached soft): "
                  f"{k['captions_per_s'] / c['captions_per_s']:.2f}x")
    for name, pad in padding.items():
        print(f"padding share of one epoch's (B, T) step-rows, {name} ({pad['captions']} "
              f"captions, batch {batch}): {100 * pad['bucketed']:.1f}% bucketed, "
              f"{100 * pad['random']:.1f}% random batches")


def _print_roofline(args: argparse.Namespace, roof: dict[str, Any] | None,
                    batching: str = "") -> None:
    if not roof:
        return
    if batching:  # the matmul rates are the first roofline's, measured again
        print(f"roofline, {batching}: decoder FLOPs per pair {roof['flops_per_pair'] / 1e9:.3f}"
              f" GFLOP; {roof['pairs_per_s']:.1f} pairs/s = {roof['achieved_gflops']:.1f} "
              f"GFLOP/s = {100 * roof['share']:.0f}% of the matmul rate "
              f"({roof['rate']:.1f} GFLOP/s in this measurement)"
              + (f"; {100 * roof['bf16_share']:.0f}% of the bf16 rate "
                 f"({roof['bf16_matmul_gflops']:.1f})" if roof.get("bf16_share") else ""))
        return
    where = "GPU" if args.device.startswith("cuda") else f"CPU, {roof['threads']} thread(s)"
    n = roof["matmul_size"]
    print(f"roofline ({where}): fp32 matmul {n}x{n}: {roof['matmul_gflops']:.1f} GFLOP/s "
          f"(best of 5; median {roof['matmul_gflops_median']:.1f})"
          + (f"; by oneDNN {roof['onednn_matmul_gflops']:.1f} GFLOP/s"
             if roof.get("onednn_matmul_gflops") else "")
          + f"; the rate: {roof['rate']:.1f}")
    m, k, p = roof["step_shape"]
    print(f"roofline: fp32 matmul at the decoder's per-word shape, the LSTM gates "
          f"({m}x{k}) x ({k}x{p}): {roof['step_matmul_gflops']:.1f} GFLOP/s (best of 100)")
    print(f"roofline: decoder FLOPs per training pair, forward + backward + optimiser "
          f"(FlopCounterMode, matmul-class ops, over the {roof['flop_pairs']} pairs of one "
          f"timing round's batches, {roof['words_per_pair']:.1f} words per pair): "
          f"{roof['flops_per_pair'] / 1e9:.3f} GFLOP")
    print(f"roofline: cached soft training at {roof['pairs_per_s']:.1f} pairs/s (mean over the "
          f"timed steps) x {roof['flops_per_pair'] / 1e9:.3f} GFLOP = "
          f"{roof['achieved_gflops']:.1f} GFLOP/s = {100 * roof['share']:.0f}% of the matmul rate")
    if roof.get("bf16_share"):
        print(f"roofline: bf16 matmul {n}x{n}: {roof['bf16_matmul_gflops']:.1f} GFLOP/s; "
              f"this bf16 run's {roof['achieved_gflops']:.1f} GFLOP/s is "
              f"{100 * roof['bf16_share']:.0f}% of it")


def _print_profile(rows: list[dict[str, Any]] | None, label: str = "") -> None:
    if not rows:
        return
    cuda = any(r["self_cuda_ms"] for r in rows)
    print(f"profile of cached soft training{label} (torch.profiler), top ops by self CPU time, "
          "per step:")
    print(f"| {'op':<40} | {'self CPU ms':>11} | {'share':>6} | {'calls':>7} |"
          + (f" {'self CUDA ms':>12} |" if cuda else ""))
    for r in rows:
        print(f"| {r['op'][:40]:<40} | {r['self_cpu_ms']:11.2f} | {100 * r['share']:5.1f}% | "
              f"{r['calls']:7.1f} |" + (f" {r['self_cuda_ms']:12.2f} |" if cuda else ""))


if __name__ == "__main__":
    sys.exit(main())
