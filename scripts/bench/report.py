"""The benchmark's report: rounds pooled into a row's figures, and the printed table, roofline and
profile."""

from __future__ import annotations

import argparse
import os
import statistics
from itertools import product
from pathlib import Path
from typing import Any

GROUPED = "train, cached, soft, by image"  # the row of `CaptionDataModule(group_by_image=True)`
BF16 = "train, cached, soft, bf16-mixed"  # the cached soft row under bf16 autocast (`--rows bf16`)


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


def grid_description(args: argparse.Namespace) -> str:
    """The annotation grid of the benchmark's CNN, e.g. 14x14x512."""
    from captioning.models.encoder import BACKBONES

    spec = BACKBONES["vgg19" if args.paper else args.encoder]
    n = 14 if args.paper else (args.grid_size or spec.side(args.image_size))
    return f"{n}x{n}x{spec.dim}"


def print_table(args: argparse.Namespace, batch: int, results: list[tuple[str, dict[str, Any]]],
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


def print_roofline(args: argparse.Namespace, roof: dict[str, Any] | None,
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


def print_profile(rows: list[dict[str, Any]] | None, label: str = "") -> None:
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
