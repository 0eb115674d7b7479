"""Probes of a training run: the step timer, GPU utilisation, FLOP counts, the profilers
(torch's, and cProfile's Python time by file), peak memory and the machine's matmul rate."""

from __future__ import annotations

import math
import resource
import statistics
import subprocess
import time
from itertools import pairwise
from typing import Any


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def step_timer(spec: dict[str, Any]) -> Any:
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


def flop_counter(warmup: int) -> Any:
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


def profiler(spec: dict[str, Any]) -> Any:
    """A callback profiling the steps after `spec["warmup"]` with `torch.profiler`; `result`
    gives the top ops by self CPU time, per step."""
    import lightning.pytorch as L
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if spec["device"].startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
        # The profiler started once before any CUDA graph is captured: one started only
        # after a capture (the fast path's warm-up) can crash or hang (torch's
        # `_init_for_cuda_graphs` does the same)
        with torch.autograd.profiler.profile():
            pass

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
            busy = device_busy_us(self.prof.events()) if len(activities) > 1 else None
            return {"profile": top_ops(self.prof.key_averages(), spec["steps"]),
                    "device_busy_ms": None if busy is None else busy / 1e3 / spec["steps"]}

    return Profile()


def python_profiler(spec: dict[str, Any]) -> Any:
    """A callback running cProfile over the steps after `spec["warmup"]` (the training thread's
    Python, and the C functions it calls); `result` gives their self time a step by source file
    (`python_by_file`, the most first). cProfile sees one thread, so autograd runs backward on
    that thread meanwhile (on CUDA it has a thread of its own). Apart from `profiler`: each
    slows the other."""
    import contextlib
    import cProfile
    import pstats

    import lightning.pytorch as L
    import torch

    class PythonProfile(L.Callback):
        def __init__(self) -> None:
            self.i, self.prof, self.ran = 0, cProfile.Profile(), False
            self.window = contextlib.ExitStack()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            if self.i == spec["warmup"]:
                self.window.enter_context(torch.autograd.set_multithreading_enabled(False))
                self.prof.enable()
                self.ran = True

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.i += 1
            if self.i == spec["warmup"] + spec["steps"]:
                self.teardown(trainer, pl_module, "fit")

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.prof.disable()  # also when the run stops inside the window
            self.window.close()

        def result(self) -> dict[str, Any]:
            if not self.ran:
                return {"python_by_file": []}
            stats = pstats.Stats(self.prof).stats  # type: ignore[attr-defined]
            return {"python_by_file": self_time_by_file(stats, spec["steps"])}

    return PythonProfile()


def self_time_by_file(stats: dict[tuple[str, int, str], tuple], steps: int,
                      n: int = 12) -> list[dict[str, Any]]:
    """cProfile's entries ({(file, line, function): (calls, ..., self s, ...)}) summed by where
    they run: a Python file from its package down (`torch/_inductor/cudagraph_trees.py`), or a
    C function by name (cProfile's file "~"); the `n` with the most self time, ms a step."""
    totals: dict[str, float] = {}
    for (file, _, function), entry in stats.items():
        where = function if file == "~" else source_name(file)
        totals[where] = totals.get(where, 0.0) + entry[2]
    whole = sum(totals.values()) or 1.0
    return [{"where": k, "self_ms": v * 1e3 / steps, "share": v / whole}
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:n]]


def source_name(file: str) -> str:
    """A source file's path from its package down: after `site-packages/`, else from the
    checkout's `captioning/`, `scripts/` or `tests/`, else as given; code that Inductor and FX
    write is one name each."""
    path = file.replace("\\", "/")
    if "/torchinductor_" in path:
        return "(Inductor's generated code)"
    if path.startswith("<eval_with_key>"):
        return "(FX's generated code)"
    for mark in ("site-packages/", "dist-packages/"):
        if mark in path:
            return path.rsplit(mark, 1)[1]
    for top in ("captioning/", "scripts/", "tests/"):
        if f"/{top}" in path:
            return top + path.rsplit(f"/{top}", 1)[1]
    return path


def device_busy_us(events: Any) -> float:
    """Microseconds in which the GPU ran something (kernels, copies, sets), from a profile's
    events (`prof.events()`): the union of the device events' spans, so that work on
    overlapping streams counts once. Below a step's period, the GPU stood idle. The device's
    annotation ranges (`record_function`, a compiled graph's call) are left out: each spans
    its first kernel to its last, idle gaps included (Inductor's benchmarks leave them out)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA
                   and getattr(e, "activity_type", None) != "gpu_user_annotation")
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


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
