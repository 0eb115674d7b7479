"""Benchmark batched beam search against decoding the same images one at a time.

    python scripts/benchmark_beam.py [--n 256] [--beam-size 5] [--batch-size 64] [--device auto]
    python scripts/benchmark_beam.py --checkpoint CKPT [--images DIR|GLOB ...]
    python scripts/benchmark_beam.py ... --fast-beam fixed|compile|graphs

Both modes call the same `captioning.models.decoding.beam_search` on annotation grids (B, L, D), so
only decoding is timed. Without a checkpoint the decoder has the demo size (embed 128, hidden
256, attention 128) over random grids of the demo shape (L = 64, D = 96), with random weights
and <end> disabled, so that every image runs `--max-len` steps in both modes (an untrained
decoder would otherwise stop after a step or two). With a checkpoint, captions end where the
model ends them, and a batch runs until its longest caption is done. `--fast-beam` adds a
third mode, batched over fixed shapes (`captioning.models.fixed_beam`), timed chunk by chunk
alongside the other two, with how many of its captions are the batched search's.
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
from bench.workers import never_end, same_captions
from torch import Tensor

from captioning.models.decoder import AttentionLSTMDecoder
from captioning.models.decoding import BeamSettings, Generation, beam_search
from captioning.models.fixed_beam import FixedBeamSearch

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


def timed(modes: dict[str, Callable[[Tensor], list[Generation]]], features: Tensor,
          batch_size: int, device: torch.device) -> dict[str, tuple[float, list[Generation]]]:
    """Seconds each mode takes to decode all `features`, and its outputs, a chunk of
    `batch_size` at a time. The modes alternate chunk by chunk (a batch, then its images one
    by one, ...), so that all see the same machine load when other processes come and go."""
    took = {name: (0.0, []) for name in modes}
    for s in range(0, features.size(0), batch_size):
        chunk = features[s:s + batch_size]
        for name, decode in modes.items():
            _sync(device)
            t0 = time.perf_counter()
            out = decode(chunk)
            _sync(device)
            seconds, gens = took[name]
            took[name] = (seconds + time.perf_counter() - t0, gens + out)
    return took


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
    p.add_argument("--fast-beam", choices=("fixed", "compile", "graphs"), default=None,
                   help="also time batched beam search over fixed shapes, by this runner")
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

    modes = {"batched": lambda chunk: [decode(chunk)],
             "one at a time": lambda chunk: [decode(chunk[i:i + 1]) for i in range(len(chunk))]}
    if args.fast_beam:
        fixed = FixedBeamSearch(decoder, args.fast_beam)
        beam = BeamSettings(beam_size=args.beam_size, **settings)
        modes[f"fast_beam {args.fast_beam}"] = lambda chunk: [fixed(chunk, beam)]
    for _ in range(2):  # warm-up: allocator, kernels, both batch shapes, graphs
        for run in modes.values():
            run(features[: args.batch_size])
        for i in range(4):
            decode(features[i:i + 1])
    _sync(device)

    runs = []
    for r in range(args.repeats):
        runs.append(timed(modes, features, args.batch_size, device))
        if args.repeats > 1:
            log.info("run %d: %s", r + 1, ", ".join(f"{name} {t:.2f} s"
                                                   for name, (t, _) in runs[-1].items()))
    seconds = {name: statistics.median(run[name][0] for run in runs) for name in modes}
    ratio = statistics.median(run["one at a time"][0] / run["batched"][0] for run in runs)
    outputs = {name: gens for name, (_, gens) in runs[-1].items()}
    tb, ts, out_b, out_s = (seconds["batched"], seconds["one at a time"], outputs["batched"],
                            outputs["one at a time"])
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
    if args.fast_beam:
        name = f"fast_beam {args.fast_beam}"
        tf = seconds[name]
        faster = statistics.median(run["batched"][0] / run[name][0] for run in runs)
        print(f"  {name} ({args.batch_size}/call): {n / tf:8.1f} images/s  ({tf:.2f} s), "
              f"{faster:.2f}x batched; same captions as batched: "
              f"{same_captions(out_b, outputs[name])}/{n}")

if __name__ == "__main__":
    main()
