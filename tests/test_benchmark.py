"""`scripts/benchmark.py` runs end to end at a tiny size (it builds through `captioning fit`'s
parser and configs, so a change there that breaks it fails here)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_runs import REPO


def test_benchmark_prints_its_table_at_a_tiny_size(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--tiny", "--rows", "cached,beam,ondevice,bf16",
         "--steps", "2", "--rounds", "1", "--warmup", "1", "--num-train", "16",
         "--batch-size", "4", "--threads", "1", "--workdir", str(tmp_path / "work"),
         "--roofline", "--json", str(tmp_path / "bench.json")],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("train, cached, soft", "train, cached, hard", "beam search, cached, soft",
                "train, cached, soft, grids on the device", "train, cached, soft, bf16-mixed"):
        assert f"| {row}" in out.stdout
    assert "padding share of one epoch's (B, T) step-rows, shapes" in out.stdout
    data = json.loads((tmp_path / "bench.json").read_text())
    assert all(r["captions_per_s"] > 0 for r in data["rows"].values())
    # an fp32 run's roofline: the fp32 rate only; its bf16 row's, both rates
    assert "of the matmul rate" in out.stdout and "bf16 matmul" not in out.stdout
    assert data["roofline"]["bf16_matmul_gflops"] is None
    assert data["roofline_bf16"]["bf16_matmul_gflops"] > 0
    assert "roofline, bf16-mixed: decoder FLOPs per pair" in out.stdout
    assert "of the bf16 rate" in out.stdout
    if torch.backends.mkldnn.is_available():  # the rate: the faster of MKL and oneDNN
        roof = data["roofline"]
        assert roof["onednn_matmul_gflops"] > 0 and "by oneDNN" in out.stdout
        assert roof["rate"] == max(roof["matmul_gflops"], roof["onednn_matmul_gflops"])
        assert roof["share"] == roof["achieved_gflops"] / roof["rate"]


def test_flops_of_onednn_products_are_counted() -> None:
    """The native path's recurrent product by oneDNN counts the FLOPs of the addmm it
    replaces: forward, and the backward's product (the weight's, one product over the pass,
    is an ATen mm either way)."""
    from bench.probes import onednn_flop_formulas
    from torch.utils.flop_counter import FlopCounterMode

    from captioning.models.pass_grads import RecurrentProduct

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    counts = []
    for onednn in (False, True):
        w = torch.randn(12, 20, requires_grad=True)
        x, bias = torch.randn(6, 12, requires_grad=True), torch.randn(6, 20)
        with FlopCounterMode(display=False, custom_mapping=onednn_flop_formulas()) as m:
            product = RecurrentProduct(w, onednn=onednn)
            assert product.onednn == onednn
            product(bias, x).sum().backward()
        counts.append(m.get_total_flops())
    assert counts[0] == counts[1] == 3 * 2 * 6 * 12 * 20


@pytest.mark.parametrize("by_image", [False, True])
def test_a_pass_counts_the_same_flops_on_the_native_path_as_on_aten(by_image: bool) -> None:
    """The native kernels' products (the score's w^T tanh(.), the context Σ α a) are counted
    as the ATen operations they replace: a teacher-forced pass and its backward count the
    same FLOPs with `fast_path` native and off, with captions of distinct images and of
    repeated ones, and more than without the kernels' formulas."""
    from bench.probes import flop_formulas, onednn_flop_formulas
    from torch.utils.flop_counter import FlopCounterMode

    from captioning.models import native
    from captioning.models.decoder import AttentionLSTMDecoder

    if not native.available():
        pytest.skip("the native kernels cannot be built here")
    grid = torch.randn(3 if by_image else 8, 10, 24).half()
    if by_image:
        grid = grid[torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])]
    lengths, captions = torch.tensor([7, 7, 6, 5, 7, 4, 6, 3]), torch.randint(4, 30, (8, 7))
    counts = {}
    for mode in ("off", "native"):
        torch.manual_seed(0)
        decoder = AttentionLSTMDecoder(vocab_size=30, feature_dim=24, embed_dim=16,
                                       hidden_dim=20, attn_dim=12)
        decoder.use_fast_path(mode)
        with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as m:
            out = decoder(grid, captions, lengths)
            (out.logits.sum() + out.alphas.sum()).backward()
        counts[mode] = m.get_total_flops()
        by_op = m.get_flop_counts()["Global"]
        assert (torch.ops.captioning_native.additive_score in by_op) == (mode == "native")
    assert counts["native"] == counts["off"]
    without = FlopCounterMode(display=False, custom_mapping=onednn_flop_formulas())
    with without:
        out = decoder(grid, captions, lengths)
        (out.logits.sum() + out.alphas.sum()).backward()
    words = int((lengths - 1).sum())  # per word and location: score 2 + 2, context 2 + 2
    assert counts["native"] - without.get_total_flops() == words * 10 * (4 * 12 + 4 * 24)


def test_roofline_and_profile_at_a_tiny_size(tmp_path: Path) -> None:
    """In bf16 (the CPU's bf16-mixed training): the roofline also measures the bf16 rate."""
    out = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--tiny", "--rows", "cached,grouped",
         "--precision", "bf16-mixed",
         "--attentions", "soft", "--roofline", "--profile", "--profile-steps", "2", "--steps", "2",
         "--rounds", "1", "--warmup", "1", "--num-train", "16", "--batch-size", "4",
         "--threads", "1", "--workdir", str(tmp_path / "work"),
         "--json", str(tmp_path / "bench.json")],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| train, cached, soft" in out.stdout
    assert "| train, cached, soft, by image" in out.stdout
    assert "roofline, by image: decoder FLOPs per pair" in out.stdout
    assert "roofline (CPU, 1 thread(s)): fp32 matmul 512x512:" in out.stdout
    assert "of the matmul rate" in out.stdout
    # batch 4; mobilenet_v2's 1280 channels + the tiny decoder's 32 units; 4 gates of 32
    assert "fp32 matmul at the decoder's per-word shape, the LSTM gates (4x1312) x (1312x128):" \
        in out.stdout
    assert "top ops by self CPU time" in out.stdout
    assert "profile of cached soft training, by image (torch.profiler)" in out.stdout
    data = json.loads((tmp_path / "bench.json").read_text())
    roof = data["roofline"]
    assert roof["matmul_gflops"] > 0 and roof["flop_pairs"] == 2 * 4  # the timed steps' pairs
    assert roof["flops_per_pair"] > 1e5  # a 32-unit decoder over 6-word captions: ~1e7
    # shares of two timed rates: positive and finite (their size is the benchmark's to print)
    assert 0 < roof["share"] < math.inf and roof["bf16_matmul_gflops"] > 0
    assert 0 < roof["bf16_share"] < math.inf
    assert "roofline: bf16 matmul 512x512:" in out.stdout
    assert "of the bf16 rate" in out.stdout  # the by-image line too
    ops = [r["op"] for r in data["profile"]]
    assert len(ops) >= 5 and any(op.startswith("aten::") for op in ops)


def test_issue17_preset_sets_the_issue_setting() -> None:
    import benchmark
    from bench.report import grid_description

    args = benchmark.parse_args(["--preset", "issue17", "--steps", "4"])
    assert (args.encoder, args.image_size, args.grid_size, args.batch_size, args.threads,
            args.num_train) == ("resnet18", 256, 14, 32, 2, 1500)
    assert args.roofline and args.rows == "cached,grouped" and args.steps == 4  # a flag wins
    assert grid_description(args) == "14x14x512"


def _has_revision(rev: str) -> bool:
    try:
        return subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                              cwd=REPO, capture_output=True).returncode == 0
    except OSError:  # no git here
        return False


@pytest.mark.skipif(not _has_revision("HEAD~1"),
                    reason="needs the git history (HEAD~1): not in a shallow clone or a tarball")
def test_against_a_revision_adds_its_row(tmp_path: Path) -> None:
    """`--against REV`: the cached soft row again, run by the code at REV (here HEAD and
    HEAD~1)."""
    out = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--tiny", "--rows", "cached", "--attentions",
         "soft", "--against", "HEAD", "HEAD~1", "--steps", "1", "--rounds", "1", "--warmup", "1",
         "--num-train", "16", "--batch-size", "4", "--threads", "1",
         "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    for rev in ("HEAD", "HEAD~1"):
        assert f"| train, cached, soft, code at {rev} " in out.stdout
        assert f"cached soft training, this code / the code at {rev}:" in out.stdout
    exported = list((tmp_path / "work").glob("rev-*/captioning/models/decoder.py"))
    assert len(exported) == 2


def test_against_adds_the_by_image_row_for_revisions_that_have_it(tmp_path: Path) -> None:
    """With `grouped` asked for, an `--against` revision whose data module has batches by image
    gets its by-image row too; an older one only its cached soft row."""
    import benchmark
    from bench.report import GROUPED

    exports = {}
    for rev, text in (("new", "group_by_image: bool = False"), ("old", "bucketing: bool")):
        module = tmp_path / rev / "captioning" / "data" / "datamodule.py"
        module.parent.mkdir(parents=True)
        module.write_text(f"class CaptionDataModule:\n    {text}\n")
        exports[rev] = str(tmp_path / rev)
    args = benchmark.parse_args(["--rows", "cached,grouped", "--attentions", "soft"])
    names = [name for name, _ in benchmark.train_configs(args, "w.pt", exports)]
    assert f"{GROUPED}, code at new" in names
    assert f"{GROUPED}, code at old" not in names
    assert {"train, cached, soft, code at new", "train, cached, soft, code at old"} <= set(names)
    spec = dict(benchmark.train_configs(args, "w.pt", exports))[f"{GROUPED}, code at new"]
    assert spec == {"code": exports["new"], "group_by_image": True}


def test_bf16_rows_run_beside_a_float32_run_only() -> None:
    """`--rows bf16` adds the cached soft row (and the by-image row) under bf16-mixed to a
    float32 run, so that the two precisions interleave; a bf16 run has them already."""
    import benchmark
    from bench.report import BF16, GROUPED

    args = benchmark.parse_args(["--rows", "cached,grouped,bf16", "--attentions", "soft"])
    configs = dict(benchmark.train_configs(args, "w.pt"))
    assert configs[BF16] == {"precision": "bf16-mixed"}
    assert configs[f"{GROUPED}, bf16-mixed"] == {"precision": "bf16-mixed",
                                                 "group_by_image": True}
    assert "precision" not in configs["train, cached, soft"] and GROUPED in configs
    args = benchmark.parse_args(["--rows", "cached,bf16", "--precision", "bf16-mixed"])
    assert not any("bf16-mixed" in name for name, _ in benchmark.train_configs(args, "w.pt"))


def test_summary_of_gpu_timeline_periods_and_of_host_steps() -> None:
    """A CUDA round's steps are its GPU-timeline periods (no per-step sync); a CPU round's
    are host step plus wait. A compiling step's outlier moves the mean, not the median."""
    from bench.report import summarize_train

    base = {"real": 0, "rows": 0, "peak_mb": 0.0, "notes": ""}
    gpu = {**base, "steps": [0.001] * 4, "waits": [0.001] * 4, "sizes": [64] * 4,
           "periods": [0.010, 0.010, 0.010, 1.0]}
    s = summarize_train([gpu])
    assert s["captions_per_s"] == 6400.0 and abs(s["step_ms"] - 10.0) < 1e-9
    assert abs(s["wait"] - 0.1) < 1e-12 and s["wait_on"] == "host"
    assert abs(s["mean_captions_per_s"] - 256 / 1.03) < 1e-9
    # The GPU's own waits between steps, where recorded: their total over the periods' total.
    s = summarize_train([{**gpu, "gpu_waits": [0.0, 0.003, 0.0, 0.0]}])
    assert s["wait_on"] == "gpu" and abs(s["wait"] - 0.003 / 1.03) < 1e-12
    assert abs(s["host_wait"] - 0.1) < 1e-12
    both = summarize_train([{**gpu, "gpu_waits": [0.001] * 4}, gpu])
    assert both["wait_on"] == "host"  # one round without them: the host measure for all
    cpu = {**base, "steps": [0.3, 0.3, 0.5], "waits": [0.1, 0.1, 0.1], "sizes": [32] * 3}
    s = summarize_train([cpu])
    assert s["captions_per_s"] == 80.0 and abs(s["step_ms"] - 300.0) < 1e-9
    assert abs(s["wait"] - 0.25) < 1e-12


def test_python_time_is_summed_by_source_file() -> None:
    """`self_time_by_file` (the Python-profiled row of `make gpu-check`): cProfile's entries
    summed by file from the package down, C functions by name, the most first, ms a step."""
    from bench.probes import self_time_by_file, source_name

    site = "/venv/lib/python3.11/site-packages/"
    stats = {(site + "torch/_inductor/cudagraph_trees.py", 1264, "run"): (10, 10, 0.030, 0.5),
             (site + "torch/_inductor/cudagraph_trees.py", 1285, "reconstruct_outputs"):
                 (10, 10, 0.010, 0.01),
             ("/work/main/captioning/models/decoder.py", 380, "_forward_fixed"):
                 (10, 10, 0.004, 0.6),
             ("~", 0, "<built-in method torch.cat>"): (20, 20, 0.006, 0.006)}
    rows = self_time_by_file(stats, steps=10)
    assert [(r["where"], round(r["self_ms"], 6)) for r in rows] == [
        ("torch/_inductor/cudagraph_trees.py", 4.0), ("<built-in method torch.cat>", 0.6),
        ("captioning/models/decoder.py", 0.4)]
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-12
    assert self_time_by_file(stats, steps=10, n=1)[0]["share"] == pytest.approx(0.8)
    assert source_name("/srv/x/scripts/bench/probes.py") == "scripts/bench/probes.py"
    assert source_name("<frozen runpy>") == "<frozen runpy>"
    assert source_name("/tmp/torchinductor_root/ab/cabc12.py") == "(Inductor's generated code)"
    assert source_name("<eval_with_key>.17") == "(FX's generated code)"


def test_the_gpus_busy_time_is_the_union_of_its_events_spans() -> None:
    """`device_busy_us` (the profile rows of `make gpu-check`): the device events' spans, work
    on overlapping streams counted once, host events left out."""
    from types import SimpleNamespace

    from bench.probes import device_busy_us
    from torch.autograd import DeviceType

    def event(device: DeviceType, start: float, end: float,
              activity: str = "kernel") -> SimpleNamespace:
        return SimpleNamespace(device_type=device, activity_type=activity,
                               time_range=SimpleNamespace(start=start, end=end))

    gpu, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [event(gpu, 10, 20), event(gpu, 15, 30),  # overlapping streams: 10..30
              event(gpu, 22, 25, "gpu_memcpy"),  # inside it
              event(gpu, 40, 45), event(cpu, 0, 100),  # a gap, then the host's op
              event(gpu, 0, 100, "gpu_user_annotation")]  # a range, its gaps included
    assert device_busy_us(events) == 25.0
    assert device_busy_us([event(cpu, 0, 100)]) == 0.0
