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
  once per image), with the grids held whole on the device and gathered there
  (`ondevice`: `data.features_on_device`) and with the decoder's fast path
  (`fast_path: compile`, `graphs` on CUDA). On the CPU the rows train with the default
  `fast_path: auto` (the native score kernel); `aten` adds the cached soft row with
  `fast_path: off` (the score by ATen operations); `bf16` adds it (and with `grouped`, the
  by-image row) under `bf16-mixed` beside a float32 run, interleaved with it: on a CPU with
  AMX or AVX512-BF16 the products run at the bf16 rate;
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
ops they replace (`bench.probes.flop_formulas`), over the very batches that a timing round times: every
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
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.data import make_base, make_coco_karpathy
from bench.process import export_revision, run_as_worker, run_worker
from bench.report import (
    BF16,
    GROUPED,
    describe_machine,
    print_profile,
    print_roofline,
    print_table,
    summarize_train,
)

log = logging.getLogger("benchmark")

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
                        "grouped (batches by image),ondevice (data.features_on_device),bf16,"
                        "aten (fast_path off),compile,beam,coco")
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
    if "ondevice" in rows:  # the grids held whole on the device, batches gathered there
        configs.append(("train, cached, soft, grids on the device",
                        {"features_on_device": True}))
    if "bf16" in rows and args.precision != "bf16-mixed":  # beside a float32 run
        configs.append((BF16, {"precision": "bf16-mixed"}))
        if "grouped" in rows:
            configs.append((f"{GROUPED}, bf16-mixed", {"precision": "bf16-mixed",
                                                       "group_by_image": True}))
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
            if BF16 in dict(results):  # its rate against both the fp32 and the bf16 rates
                extra["roofline_bf16"] = run_roofline(base, args, dict(results)[BF16],
                                                      {"precision": "bf16-mixed"})
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

    print_table(args, args.batch_size, results, padding)
    print_roofline(args, extra.get("roofline"))
    print_roofline(args, extra.get("roofline_grouped"), "by image")
    print_roofline(args, extra.get("roofline_bf16"), "bf16-mixed")
    print_profile(extra.get("profile"))
    print_profile(extra.get("profile_grouped"), ", by image")
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


if __name__ == "__main__":
    sys.exit(main())
