"""Benchmark batched beam search against decoding the same images one at a time.

    python scripts/benchmark_beam.py [--n 256] [--beam-size 5] [--batch-size 64] [--device auto]
    python scripts/benchmark_beam.py --checkpoint CKPT [--images DIR|GLOB ...]

Both modes call the same `captioning.models.decoding.beam_search` on annotation grids (B, L, D), so
only decoding is timed. Without a checkpoint the decoder has the demo size (embed 128, hidden
256, attention 128) over random grids of the demo shape (L = 64, D = 96), with random weights
and <end> disabled, so that every image runs `--max-len` steps in both modes (an untrained
decoder would otherwise stop after a step or two). With a checkpoint, captions end where the
model ends them, and a batch runs until its longest caption is done.
The grids come from its encoder on shapes test images (generated into a temporary folder when
no --images are given), computed once before timing.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench.workers import never_end
from torch import Tensor

from captioning.models.decoder import AttentionLSTMDecoder
from captioning.models.decoding import Generation, beam_search

log = logging.getLogger("benchmark_beam")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_setup(args: argparse.Namespace) -> tuple[AttentionLSTMDecoder, Tensor, dict]:
    """Demo-size decoder with random weights and random (n, L, D) grids."""
    torch.manual_seed(0)
    decoder = AttentionLSTMDecoder(vocab_size=args.vocab_size, feature_dim=args.dim,
                                   embed_dim=128, hidden_dim=256, attn_dim=128, dropout=0.0)
    never_end(decoder)
    features = torch.randn(args.n, args.locations, args.dim).relu()  # post-ReLU activations
    return decoder.eval(), features, {"max_len": args.max_len}


@torch.inference_mode()
def checkpoint_setup(args: argparse.Namespace) -> tuple[AttentionLSTMDecoder, Tensor, dict]:
    """The checkpoint's decoder, and its encoder's grids of n shapes (or --images) images."""
    from captioning.checkpoint import load_checkpoint
    from captioning.commands.caption import expand_inputs
    from captioning.data.datamodule import build_image_transform
    from captioning.data.images import load_image
    from captioning.data.shapes import generate_shapes

    model = load_checkpoint(args.checkpoint)
    size = model.config.image_size
    if args.images:
        paths = expand_inputs(args.images).paths
    else:
        root = generate_shapes(Path(tempfile.mkdtemp()) / "shapes", num_train=0, num_val=0,
                               num_test=args.n, image_size=max(size, 64))
        paths = sorted((root / "images").glob("test_*.png"))
    paths = (paths * (-(-args.n // max(1, len(paths)))))[: args.n]  # repeat up to n
    if not paths:
        raise SystemExit("no images to decode")
    transform = build_image_transform(size)
    grids = []
    for s in range(0, len(paths), 64):
        batch = torch.stack([transform(load_image(p, min_side=size)) for p in paths[s:s + 64]])
        grids.append(model.captioner.encode(batch))
    settings = {"max_len": args.max_len or model.decode.max_len,
                "length_penalty": model.decode.length_penalty,
                "forbid_unk": model.decode.forbid_unk}
    return model.captioner.decoder, torch.cat(grids), settings


def timed(decode: Callable[[Tensor], Generation], features: Tensor, batch_size: int,
          device: torch.device) -> tuple[float, float, list[Generation], list[Generation]]:
    """Seconds to decode all `features` batched and one at a time, and both outputs.

    The two modes alternate chunk by chunk (a batch, then its images one by one), so that
    both see the same machine load when other processes come and go."""
    t_batched = t_single = 0.0
    batched: list[Generation] = []
    single: list[Generation] = []
    for s in range(0, features.size(0), batch_size):
        chunk = features[s:s + batch_size]
        _sync(device)
        t0 = time.perf_counter()
        batched.append(decode(chunk))
        _sync(device)
        t1 = time.perf_counter()
        single += [decode(chunk[i:i + 1]) for i in range(chunk.size(0))]
        _sync(device)
        t_batched, t_single = t_batched + t1 - t0, t_single + time.perf_counter() - t1
    return t_batched, t_single, batched, single


def same_captions(a: list[Generation], b: list[Generation]) -> int:
    """How many images got the same words in both runs."""
    def rows(gens: list[Generation]) -> list[list[int]]:
        return [t[:n] for g in gens for t, n in zip(g.tokens.tolist(), g.lengths.tolist())]

    return sum(x == y for x, y in zip(rows(a), rows(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256, help="images to decode")
    p.add_argument("--beam-size", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="images per batched call")
    p.add_argument("--max-len", type=int, default=None,
                   help="default 20 (random decoder) or the checkpoint's setting")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the median is reported")
    p.add_argument("--checkpoint", default=None, help="decode with a trained model")
    p.add_argument("--images", nargs="*", default=None, help="with --checkpoint: images to use")
    p.add_argument("--locations", type=int, default=64, help="L of the random grids")
    p.add_argument("--dim", type=int, default=96, help="D of the random grids")
    p.add_argument("--vocab-size", type=int, default=50, help="words of the random decoder")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if args.max_len is None and args.checkpoint is None:
        args.max_len = 20

    decoder, features, settings = (checkpoint_setup(args) if args.checkpoint
                                   else random_setup(args))
    decoder, features = decoder.to(device), features.to(device)

    @torch.inference_mode()
    def decode(feats: Tensor) -> Generation:
        return beam_search(decoder, feats, beam_size=args.beam_size, **settings)

    for _ in range(2):  # warm-up: allocator, kernels, both batch shapes
        decode(features[: args.batch_size])
        for i in range(4):
            decode(features[i:i + 1])
    _sync(device)

    runs = []
    for r in range(args.repeats):
        tb, ts, out_b, out_s = timed(decode, features, args.batch_size, device)
        runs.append((tb, ts))
        if args.repeats > 1:
            log.info("run %d: batched %.2f s, one at a time %.2f s, speed-up %.1fx",
                     r + 1, tb, ts, ts / tb)
    tb = statistics.median(t for t, _ in runs)
    ts = statistics.median(t for _, t in runs)
    ratio = statistics.median(s / b for b, s in runs)
    n = features.size(0)
    steps = sum(int(g.lengths.max()) for g in out_s) / n
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"cpu, {torch.get_num_threads()} threads")
    source = args.checkpoint or (f"random demo-size decoder, grids L={features.size(1)} "
                                 f"D={features.size(2)}")
    print(f"beam search, beam {args.beam_size}, {n} images, {source}; {where}; "
          f"torch {torch.__version__}; median of {args.repeats} run(s)")
    print(f"  batched ({args.batch_size}/call): {n / tb:8.1f} images/s  ({tb:.2f} s)")
    print(f"  one at a time:        {n / ts:8.1f} images/s  ({ts:.2f} s)")
    print(f"  speed-up: {ratio:.1f}x   mean steps per image: {steps:.1f}   "
          f"same captions: {same_captions(out_b, out_s)}/{n}")

if __name__ == "__main__":
    main()
