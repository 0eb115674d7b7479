"""GPU-only checks (`pytest -m gpu`, run by `make gpu-check`): bf16 training steps are finite,
beam search on CUDA gives the CPU's captions for the same weights (and, over fixed shapes,
compiled or replayed as CUDA graphs, beam_search's captions), attention overlays render
on the device, the feature cache builds on the device and its grids gather there
(`features_on_device`). Skipped without CUDA.

Each test calls a `check_*` helper with the device, so that the same code can be read (and
tried) on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bench.data import make_base
from bench.report import summarize_train
from bench.workers import never_end, worker_train
from PIL import Image

from captioning.data.datamodule import CaptionDataModule
from captioning.data.features import FeatureCache
from captioning.data.serving import attach_feature_cache
from captioning.data.transforms import build_image_transform
from captioning.lit_module import CaptioningModule
from captioning.models.captioner import Captioner, CaptionerConfig, DecodeConfig
from captioning.models.decoding import SpecialIds
from captioning.models.encoder import CNNEncoder
from captioning.optim import StepGuard
from captioning.viz import render_strips

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

S = 64  # image size
VOCAB = 24


@pytest.fixture
def exact_fp32() -> Iterator[None]:
    """No TF32 in matmuls or convolutions while the test runs: CUDA and CPU then differ by
    rounding only."""
    # torch's fp32_precision switches: once they are set, reading the legacy allow_tf32 raises
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    old = matmul.fp32_precision, conv.fp32_precision
    matmul.fp32_precision = conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = old


def tiny_net(attention: str = "soft") -> CaptionerConfig:
    return CaptionerConfig(vocab_size=VOCAB, backbone="resnet18", weights=None, grid_size=3,
                           image_size=S, embed_dim=32, hidden_dim=48, attn_dim=32,
                           dropout=0.0, attention=attention)


def random_batch(device: str) -> object:
    """Five images (3, S, S) with captions of lengths 7..3 (<start> .. <end> <pad>)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 7, 5, 4, 3])
    captions = torch.randint(4, VOCAB, (5, 7), generator=g)
    captions[:, 0] = SpecialIds().start
    for i, n in enumerate(lengths.tolist()):
        captions[i, n - 1], captions[i, n:] = SpecialIds().end, SpecialIds().pad
    images = torch.randn(5, 3, S, S, generator=g)
    return type("Batch", (), {"images": images.to(device), "captions": captions.to(device),
                              "lengths": lengths.to(device)})()


def check_bf16_step(device: str, attention: str) -> None:
    """One training loss (the CNN included) under bf16 autocast: finite, as its gradients."""
    torch.manual_seed(0)
    module = CaptioningModule(net=tiny_net(attention)).to(device).train()
    batch = random_batch(device)
    torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        parts = module.losses(batch)
        out = module.captioner(batch.images, batch.captions, batch.lengths)
    assert out.logits.dtype == torch.bfloat16  # the matmuls did run in bf16
    assert out.alphas.dtype == torch.float32  # the attention softmax stays float32
    assert torch.isfinite(parts["loss"])
    parts["loss"].backward()
    grads = [p.grad for p in module.captioner.decoder.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def trained_looking_captioner() -> Captioner:
    """A random captioner that never says <end>: every beam runs `max_len` steps, so that the
    comparison covers every step. Its word scores are spread wide (x8), as a trained model's
    are, so that no two beams tie within rounding."""
    torch.manual_seed(0)
    captioner = Captioner(tiny_net()).eval()
    with torch.no_grad():
        captioner.decoder.out.weight.mul_(8)
    never_end(captioner.decoder)
    return captioner


def check_beam_matches_cpu(device: str, fast_beam: str = "off") -> None:
    """Beam search on `device` by `fast_beam` (`auto`: CUDA graphs there) against
    `beam_search` on the CPU, for the same weights."""
    captioner = trained_looking_captioner()
    captioner.use_fast_beam(fast_beam)  # type: ignore[arg-type]
    assert captioner.beam_runner(torch.device("cpu")) is None
    features = torch.randn(6, 9, 512, generator=torch.Generator().manual_seed(1)).relu()
    decode = DecodeConfig(strategy="beam", beam_size=3, max_len=12, num_captions=2)
    with torch.no_grad():
        cpu = captioner.generate(features, decode)
        dev = captioner.to(device).generate(features.to(device), decode)
    assert dev.tokens.device.type == torch.device(device).type
    if fast_beam == "auto" and device == "cuda":  # decoded by its captured graph
        assert len(captioner.fast_beam.graphed) == 1  # type: ignore[union-attr]
    assert torch.equal(dev.tokens.cpu(), cpu.tokens)
    assert torch.equal(dev.lengths.cpu(), cpu.lengths)
    torch.testing.assert_close(dev.scores.cpu(), cpu.scores, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dev.alphas.cpu(), cpu.alphas, atol=1e-5, rtol=1e-4)


def ending_captioner() -> Captioner:
    """A random captioner whose captions end after a few words, at different steps: beam
    search drops each image's rows as its search ends."""
    torch.manual_seed(0)
    captioner = Captioner(tiny_net()).eval()
    with torch.no_grad():
        captioner.decoder.out.weight.mul_(8)
        captioner.decoder.out.bias[SpecialIds.end] += 4.0
    captioner.use_fast_beam("off")  # beam_search: what the fixed shapes must equal
    return captioner


def check_fixed_beam_matches_beam_search(device: str, runner: str) -> None:
    """`use_fast_beam(runner)` on `device`: beam_search's captions there, for a batch, the same
    batch again and a smaller one (padded up: `graphs` replays the one graph it captured); then,
    with a fresh search, a second shape, the first again, and the model after a round trip off
    the device."""
    captioner = ending_captioner().to(device)
    features = torch.randn(8, 9, 512, generator=torch.Generator().manual_seed(1)).relu()
    features = features.to(device)
    decode = DecodeConfig(strategy="beam", beam_size=3, max_len=12, num_captions=2)
    batches = (features, features, features[:5])
    with torch.no_grad():
        want = [captioner.generate(f, decode) for f in batches]
        captioner.use_fast_beam(runner)  # type: ignore[arg-type]
        got, graphs = [], []
        for f in batches:
            got.append(captioner.generate(f, decode))
            graphs += list(captioner.fast_beam.graphed.values())  # type: ignore[union-attr]
    lengths = torch.cat([g.lengths for g in want])
    finished = torch.cat([g.finished for g in want])
    assert len(set(lengths.tolist())) >= 3 and finished.any() and not finished.all()
    for a, b in zip(want, got):
        assert b.tokens.device.type == torch.device(device).type
        assert torch.equal(b.tokens, a.tokens) and torch.equal(b.lengths, a.lengths)
        assert torch.equal(b.finished, a.finished) and torch.equal(b.locations, a.locations)
        torch.testing.assert_close(b.scores, a.scores, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(b.alphas, a.alphas, atol=1e-5, rtol=1e-4)
    if runner == "graphs":  # one shape: one capture (on the CPU, its in-place step uncaptured)
        assert len(graphs) == 3 and all(g is graphs[0] for g in graphs)
    # A fresh search: a batch of one (its own shape), the batch of 8 (on CUDA a second capture,
    # into the same pool), the batch of one again (its graph replayed after the other's), then
    # the model moved off the device and back: its weights at new addresses (the old ones are
    # held meanwhile, so that none comes back where it was), captured again on CUDA.
    with torch.no_grad():
        captioner.use_fast_beam("off")
        want_one = captioner.generate(features[:1], decode)
        captioner.use_fast_beam(runner)  # type: ignore[arg-type]
        search = captioner.fast_beam
        for f, w in ((features[:1], want_one), (features, want[0]), (features[:1], want_one)):
            assert torch.equal(captioner.generate(f, decode).tokens, w.tokens)
        held = [p.data for p in captioner.parameters()]
        captioner.cpu().to(device)
        assert torch.equal(captioner.generate(features, decode).tokens, want[0].tokens)
        del held
    if runner == "graphs":
        assert len(search.graphed) == (3 if device == "cuda" else 2)  # type: ignore[union-attr]
        assert len(search.sites) == (device == "cuda")  # type: ignore[union-attr]


def check_graphs_outlive_eviction_and_cleared_workspaces(device: str) -> None:
    """`graphs` kept through a fifth batch shape (the first dropped) and cuBLAS's workspaces
    dropped, as CUDA-graph trees drop them when they record: the oldest graph kept still gives
    beam_search's captions, and writes nothing into memory freed meanwhile (a NaN filler
    allocated after the drop stays NaN)."""
    captioner = ending_captioner().to(device)
    features = torch.randn(16, 9, 512, generator=torch.Generator().manual_seed(2)).relu()
    features = features.to(device)
    decode = DecodeConfig(strategy="beam", beam_size=3, max_len=12, num_captions=2)
    sizes = (1, 2, 4, 8, 16)  # five shapes: 4 kept
    with torch.no_grad():
        want = {n: captioner.generate(features[:n], decode).tokens for n in sizes}
        captioner.use_fast_beam("graphs")
        search = captioner.fast_beam
        for n in sizes:
            assert torch.equal(captioner.generate(features[:n], decode).tokens, want[n])
        assert len(search.graphed) == 4  # type: ignore[union-attr]
        filler = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            filler = torch.full((64, 1024, 1024), float("nan"), device=device)  # 256 MB
        assert torch.equal(captioner.generate(features[:2], decode).tokens, want[2])
        if filler is not None:
            assert bool(filler.isnan().all())


def check_overlay_on_device(device: str) -> None:
    """Decode and render on the device, no host copy between: the strips are the CPU's (to
    one level of uint8 rounding)."""
    captioner = trained_looking_captioner().to(device)
    images = random_batch(device).images[:3]
    with torch.no_grad():
        gen = captioner.generate(images, DecodeConfig(strategy="greedy", max_len=5))
    words = [[f"w{t}" for t in row[:n]] for row, n in zip(gen.tokens.tolist(),
                                                          gen.lengths.tolist())]
    strips = render_strips(images, gen.alphas, captioner.grid, words)
    assert strips.device.type == torch.device(device).type and strips.dtype == torch.uint8
    assert strips.shape == (3, S + 14, S * (max(map(len, words)) + 1), 3)
    cpu = render_strips(images.cpu(), gen.alphas.cpu(), captioner.grid, words)
    assert (strips.cpu().int() - cpu.int()).abs().max() <= 1


def check_cache_builds_on(device: str, images: list[Path], tmp_path: Path) -> None:
    """The cache built on the device holds the CPU encoder's grids (float16), and the encoder
    is back where it was."""
    torch.manual_seed(0)
    encoder = CNNEncoder(backbone="resnet18", weights=None, grid_size=2).eval()
    transform = build_image_transform(S)
    cache = FeatureCache.build(cache_dir=tmp_path / "features", encoder=encoder,
                               encoder_config={"backbone": "resnet18", "device": device},
                               image_size=S, paths=images, transform=transform,
                               batch_size=4, device=device, progress=False)
    assert next(encoder.parameters()).device.type == "cpu"
    assert cache.array.dtype == np.float16 and cache.array.shape[0] == len(images)
    with torch.no_grad():
        ref = encoder(torch.stack([transform(Image.open(p).convert("RGB")) for p in images]))
    got = torch.stack([cache[p] for p in images]).float()
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=1e-2)


def check_grids_gather_on(device: str, shapes_dm_kwargs: dict, tmp_path: Path) -> None:
    """Grids held on the device (`features_on_device`): the first training batch's rows,
    moved there, gather the loader's batch of grids, on the device."""
    batches = []
    for on_device in (False, True):
        dm = CaptionDataModule(**{**shapes_dm_kwargs, "batch_size": 8, "feature_cache": True,
                                  "cache_dir": str(tmp_path / "f"),
                                  "features_on_device": on_device})
        dm.setup("fit")
        torch.manual_seed(0)
        encoder = CNNEncoder(backbone="resnet18", weights=None, grid_size=2).eval()
        attach_feature_cache(dm, encoder, {"backbone": "resnet18", "device": device},
                             device=device)
        batch = next(iter(dm.train_dataloader()))
        batches.append(dm.on_after_batch_transfer(batch.to(device), 0))
    assert dm.device_grids.held["train"].device.type == device  # held there, not gathered on the host
    assert batches[1].images.device.type == device
    assert torch.equal(batches[1].images, batches[0].images)


def check_fast_path_matches_eager(device: str, mode: str) -> None:
    """The fixed-shape pass (`mode`: compile, or graphs on CUDA) gives the eager loop's loss and
    gradients, on three batches of two lengths (two graphs, one replayed), then under bf16
    autocast a finite loss."""
    torch.manual_seed(0)
    eager = CaptioningModule(net=tiny_net()).to(device).train()
    fast = CaptioningModule(net=tiny_net()).to(device).train()
    fast.load_state_dict(eager.state_dict())
    fast.captioner.decoder.use_fast_path(mode, bucket=4)
    feats = torch.randn(5, 9, 512, device=device).relu()
    full = random_batch(device)
    short = type("Batch", (), {"captions": full.captions[:, :4].clone(),
                               "lengths": full.lengths.clamp_max(4)})()
    short.captions[:, 3] = torch.where(full.lengths > 3, SpecialIds().end, short.captions[:, 3])
    for b in (full, short, full):
        losses = []
        torch.compiler.cudagraph_mark_step_begin()  # as the training step does
        for module in (eager, fast):
            module.zero_grad()
            loss = module.objective(module.captioner, feats, b)["loss"]
            loss.backward()
            losses.append((loss.detach(), {n: p.grad.clone() for n, p in
                                           module.captioner.decoder.named_parameters()}))
        (la, ga), (lb, gb) = losses
        torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
        for name in ga:
            torch.testing.assert_close(gb[name], ga[name], atol=1e-5, rtol=1e-4, msg=name)


def check_fast_path_bf16(device: str, mode: str) -> None:
    """Training steps of the fast path under bf16 autocast, as bf16-mixed runs them (warm-up,
    capture, replay): finite losses and gradients, and they go down on a fixed batch."""
    torch._dynamo.reset()  # a fresh start: no graphs of another precision
    torch.manual_seed(0)
    module = CaptioningModule(net=tiny_net()).to(device).train()
    module.captioner.decoder.use_fast_path(mode, bucket=4)
    opt = torch.optim.Adam(module.captioner.decoder.parameters(), lr=1e-2)
    feats, b = torch.randn(5, 9, 512, device=device).relu(), random_batch(device)
    losses = []
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = module.objective(module.captioner, feats, b)["loss"]
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in module.captioner.decoder.parameters()
                   if p.grad is not None)
        opt.step()
        losses.append(float(loss.detach()))
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses


def check_guard_needs_no_sync(device: str) -> None:
    """Fused Adam's step guard (`StepGuard`): a clean step's check, clipping and update run
    without a host sync, and its norm is `get_total_norm`'s (sync debug mode "error" would raise); an inf loss's update is
    skipped on the device and the error comes at the next check, the weights and the
    optimiser state untouched."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    guard, x = StepGuard(model.named_parameters), torch.randn(16, 8, device=device)

    def step(k: int, scale: float, *, strict: bool = True) -> None:
        opt.zero_grad()
        loss = model(x).pow(2).mean() * scale
        loss.backward()
        guard.add_loss(loss, None, 0, step=k, epoch=0)
        torch.cuda.set_sync_debug_mode("error" if strict else 0)
        try:
            guard.check(opt, step=k)
            reference = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            guard.clip(opt, 0.5)
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if math.isfinite(scale):  # the norm that clips is clip_grad_norm_'s, to the bit
            assert guard.grad_norm is not None and torch.equal(guard.grad_norm, reference)

    step(0, 1.0, strict=False)  # the optimiser's state is made on the first step
    step(1, 1.0)
    before = ({k: v.clone() for k, v in model.state_dict().items()},
              {k: v.clone() for k, v in opt.state[model.weight].items()})
    step(2, math.inf)  # no error yet: the flag is on its way
    with pytest.raises(FloatingPointError, match="training loss inf at global step 2"):
        step(3, 1.0, strict=False)
    for k, v in before[0].items():
        assert torch.equal(model.state_dict()[k], v), k
    for k, v in before[1].items():
        assert torch.equal(opt.state[model.weight][k], v), k


def check_step_timer_reads_the_gpu_timeline(device: str, work: Path) -> None:
    """The benchmark's training worker times CUDA steps by events, without a sync per step:
    one period (end to end) and one GPU wait per timed step, each wait within its period,
    with or without warm-up steps before them."""
    base = make_base(work, device=device, encoder="resnet18", grid_size=4, tiny=True,
                     batch_size=4, num_train=16, num_val=8, image_size=64, steps=3)
    for warmup in (0, 1):
        res = worker_train({**base, "kind": "train", "attention": "soft", "cached": True,
                            "num_workers": 0, "warmup": warmup, "precision": "bf16-mixed"})
        assert len(res["periods"]) == len(res["gpu_waits"]) == len(res["steps"]) == 3
        assert all(0 <= w <= p for w, p in zip(res["gpu_waits"], res["periods"]))
        assert all(p > 0 for p in res["periods"])
        assert summarize_train([res])["wait_on"] == "gpu"


def check_fit_on_the_fast_path(device: str, mode: str, precision: str, bucket: int,
                               shapes_dm_kwargs: dict[str, Any], tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """A Lightning fit on the fast path (`mode`, `bucket`): two epochs of batches of 7 pairs,
    the last one smaller, with the sanity check and validation. Every training step ran the fixed-shape
    pass, from the first full batch on at that batch's rows, the smaller batch too; validation
    ran none (its loss has no gradient: the eager loop); the losses are finite. Each
    validation's first batch, decoded by the default `fast_beam` (`auto`: on CUDA one graph,
    captured at the sanity check and replayed after training's own graphs recorded), gives
    the `fixed` runner's captions, and in fp32 `beam_search`'s. Returns the shapes of the
    pass's tokens, call by call."""
    from dataclasses import asdict

    import lightning.pytorch as L

    from captioning.models.decoding import beam_search
    from captioning.models.fast_path import FixedPass
    from captioning.models.fixed_beam import FixedBeamSearch

    calls: list[tuple[int, ...]] = []
    call = FixedPass.__call__

    def recorded(self: FixedPass, *args: Any) -> Any:
        assert torch.is_grad_enabled()
        calls.append(tuple(args[1].shape))
        return call(self, *args)

    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                               outputs: Any, batch: Any, batch_idx: int) -> None:
            losses.append(float(outputs["loss"]))

    decoded: list[tuple[list[Any], bool]] = []  # the beam graphs kept, the same captions

    class Decode(L.Callback):
        def on_validation_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any,
                                    batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            if batch_idx:
                return
            captioner, d = pl_module.captioner, pl_module.decode
            weight = captioner.decoder.out.weight
            weight.mul_(8)  # word scores spread wide: no near-ties (undone exactly below)
            try:  # under the run's precision, as validation_step encodes and decodes
                with trainer.precision_plugin.val_step_context():
                    features = captioner.encode(batch.images)
                    got = captioner.generate(features, d)
                    # `fixed`: the same shapes uncaptured, so the same products. beam_search
                    # drops finished images' rows, and at other row counts a bf16 product may
                    # round otherwise: it is compared in fp32 only.
                    want = [FixedBeamSearch(captioner.decoder, "fixed")(features,
                                                                      d.beam_settings())]
                    if precision == "32-true":
                        want.append(beam_search(captioner.decoder, features,
                                                **asdict(d.beam_settings())))
            finally:
                weight.div_(8)
            graphs = captioner.fast_beam.graphed.values() if captioner.fast_beam else ()
            decoded.append((list(graphs), all(torch.equal(got.tokens, w.tokens) for w in want)))

    monkeypatch.setattr(FixedPass, "__call__", recorded)
    torch._dynamo.reset()  # no graphs left by another test
    try:
        L.seed_everything(0, verbose=False)
        dm = CaptionDataModule(**{**shapes_dm_kwargs, "batch_size": 7}, feature_cache=False)
        module = CaptioningModule(vocab_size=dm.vocab_size, net=tiny_net(), fast_path=mode,
                                  fast_bucket=bucket, compute_metrics=False)
        trainer = L.Trainer(max_epochs=2, accelerator=device, devices=1, precision=precision,
                            logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path, callbacks=[Losses(), Decode()])
        dm.setup("fit")
        sizes = [len(b) for b in dm.train_dataloader().batch_sampler]
        assert min(sizes) < 7 == max(sizes)  # a smaller last batch
        trainer.fit(module, datamodule=dm)
    finally:
        torch._dynamo.reset()
    assert module.captioner.decoder.fast_path == mode
    assert math.isfinite(float(trainer.callback_metrics["val/loss"]))
    assert len(losses) == 2 * len(sizes) and all(map(math.isfinite, losses))
    assert len(calls) == 2 * len(sizes)  # every training step, on the fast path
    rows = [shape[0] for shape in calls]
    assert set(rows[rows.index(7):]) == {7}  # the second epoch's smaller batch among them
    assert len(decoded) == 3 and all(same for _, same in decoded)  # sanity check, 2 epochs
    graphs = [kept for kept, _ in decoded]  # on CUDA one, captured once and kept
    assert all(len(kept) == (device == "cuda") for kept in graphs)
    assert all(a is b for kept in graphs for a, b in zip(kept, graphs[0]))
    return calls


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_bf16_forward_and_backward_are_finite(attention: str) -> None:
    check_bf16_step("cuda", attention)


@pytest.mark.parametrize("mode", ["compile", "graphs"])
def test_fast_path_equals_eager_on_cuda(mode: str, exact_fp32: None) -> None:
    check_fast_path_matches_eager("cuda", mode)


@pytest.mark.parametrize("mode", ["compile", "graphs"])
def test_fast_path_trains_in_bf16_on_cuda(mode: str) -> None:
    check_fast_path_bf16("cuda", mode)


def test_a_fit_on_graphs_replays_a_graph_a_bucket(
        shapes_dm_kwargs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One bucket (the shapes captions are shorter): few compiles and recordings, little time
    check_fit_on_the_fast_path("cuda", "graphs", "bf16-mixed", 32, shapes_dm_kwargs, tmp_path,
                               monkeypatch)


@pytest.mark.parametrize("fast_beam", ["off", "auto"])
def test_beam_search_on_cuda_equals_cpu(fast_beam: str, exact_fp32: None) -> None:
    check_beam_matches_cpu("cuda", fast_beam)


@pytest.mark.parametrize("runner", ["compile", "graphs"])
def test_fixed_beam_search_on_cuda_equals_beam_search(runner: str, exact_fp32: None) -> None:
    check_fixed_beam_matches_beam_search("cuda", runner)


def test_beam_graphs_outlive_eviction_and_cleared_workspaces(exact_fp32: None) -> None:
    check_graphs_outlive_eviction_and_cleared_workspaces("cuda")


def test_overlays_render_on_the_device(exact_fp32: None) -> None:
    check_overlay_on_device("cuda")


def test_feature_cache_builds_on_the_device(copied_images: list[Path], tmp_path: Path,
                                            exact_fp32: None) -> None:
    check_cache_builds_on("cuda", copied_images, tmp_path)


def test_grids_on_the_device_gather_the_loaders_batch(shapes_dm_kwargs: dict,
                                                      tmp_path: Path) -> None:
    check_grids_gather_on("cuda", shapes_dm_kwargs, tmp_path)


def test_step_guard_with_fused_adam_needs_no_sync() -> None:
    check_guard_needs_no_sync("cuda")


def test_benchmark_times_steps_on_the_gpu_timeline(tmp_path: Path) -> None:
    check_step_timer_reads_the_gpu_timeline("cuda", tmp_path)
