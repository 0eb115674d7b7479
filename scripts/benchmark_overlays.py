"""Benchmark `captioning.viz.render_strips`: strips per second on CPU (and CUDA if available).

    python scripts/benchmark_overlays.py [--captions 64] [--words 16] [--size 224] [--grid 14]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from captioning.viz import UPSAMPLE_MODES, render_strips

log = logging.getLogger("benchmark_overlays")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(device: torch.device, *, captions: int, words: int, size: int, grid: int,
          upsample: str, hard: bool, warmup: int, repeats: int) -> tuple[float, float, float]:
    """(strips per second, ms per batch, best ms per batch); the first two use the median of
    `repeats` timed batches."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(captions, 3, size, size, generator=g).to(device)
    alphas = torch.softmax(torch.randn(captions, words, grid * grid, generator=g) * 3, -1)
    alphas = alphas.to(device)
    points = alphas.argmax(-1) if hard else None
    vocab = ["a", "red", "circle", "and", "two", "blue", "squares", "next", "to", "triangle"]
    caps = [[vocab[(i + t) % len(vocab)] for t in range(words - i % 3)] for i in range(captions)]
    caps[0] = [vocab[t % len(vocab)] for t in range(words)]  # at least one full-length caption

    def run() -> torch.Tensor:
        return render_strips(images, alphas, (grid, grid), caps, points=points, upsample=upsample)

    for _ in range(warmup):
        run()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    ms = sorted(times)[len(times) // 2] * 1000.0
    return captions / (ms / 1000.0), ms, min(times) * 1000.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--captions", type=int, default=64)
    p.add_argument("--words", type=int, default=16)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--grid", type=int, default=14)
    p.add_argument("--upsample", choices=UPSAMPLE_MODES, default="bicubic")
    p.add_argument("--hard", action="store_true", help="also draw hard-attention markers")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--devices", default="cpu,cuda", help="comma-separated; cuda is skipped if "
                   "unavailable")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = []
    for name in args.devices.split(","):
        if name == "cuda" and not torch.cuda.is_available():
            log.info("cuda: not available, skipped")
            continue
        device = torch.device(name)
        sps, ms, best = bench(device, captions=args.captions, words=args.words, size=args.size,
                        grid=args.grid, upsample=args.upsample, hard=args.hard,
                        warmup=args.warmup, repeats=args.repeats)
        label = name if name != "cpu" else f"cpu ({torch.get_num_threads()} threads)"
        if device.type == "cuda":
            label = f"cuda ({torch.cuda.get_device_name(device)})"
        rows.append((label, sps, ms, best))

    print(f"render_strips: {args.captions} captions x {args.words} words, {args.size}px, "
          f"{args.grid}x{args.grid} grid, {args.upsample}{', hard markers' if args.hard else ''}")
    print(f"{'device':<40} {'strips/s':>10} {'ms/batch':>10} {'best ms':>10}")
    for label, sps, ms, best in rows:
        print(f"{label:<40} {sps:>10.1f} {ms:>10.1f} {best:>10.1f}")


if __name__ == "__main__":
    main()
