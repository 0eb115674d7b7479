"""The Lightning module and its checkpoints (captioning/lit_module.py, checkpoint checks): a
NaN input or an inf gradient stops the run naming the step, with the weights untouched;
checkpoints hold plain data only (loadable with `weights_only=True`); a mismatched vocabulary
or config is named."""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import tiny_runs as runs
import torch

from captioning.checkpoint import CheckpointError
from captioning.lit_module import CaptioningModule
from captioning.optim import StepGuard

pytestmark = pytest.mark.usefixtures("signal_handlers_restored")


# ------------------------------------------------------------------------------------------
# Non-finite values


@pytest.mark.parametrize(("attention", "what", "fused", "at"), [
    ("soft", "nan", False, 2), ("hard", "nan", False, 2), ("soft", "inf_grad", False, 2),
    ("soft", "nan", True, 2), ("soft", "inf_grad", True, 2), ("soft", "nan", True, 1),
    ("soft", "inf_grad", True, 1)])  # fused: the check without a sync
def test_non_finite_values_stop_before_the_weights_change(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path, attention: str,
        what: str, fused: bool, at: int) -> None:
    """Fused Adam skips the bad update on the device (`found_inf`) and the error comes at
    the next step's check (at 1) or before validation (at 2, the epoch's last batch): the
    weights and the optimiser state are as they were, and no checkpoint is written."""
    L.seed_everything(0)
    dm = runs.make_dm(shapes_dm_kwargs, cache_dir)
    module = runs.make_module(dm, attention)
    module.hparams.fused_adam = fused
    breaker = runs.BreakAt(what, batch=at)
    trainer = runs.make_trainer(tmp_path / "ckpt", breaker, max_epochs=1)
    with pytest.raises(FloatingPointError) as info:
        trainer.fit(module, datamodule=dm)
    msg = str(info.value)
    assert f"at global step {at}" in msg and "stopping before" in msg
    assert trainer.optimizers[0].defaults["fused"] is (True if fused else None)
    if what == "nan":
        assert repr(breaker.image_id) in msg  # the image whose input is bad
    else:
        assert "captioner.decoder.out.weight" in msg  # the first non-finite gradient
    assert breaker.before is not None
    runs.assert_same(runs.snapshot(module, trainer), breaker.before)
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()  # not an interruption: no save


@pytest.mark.parametrize(("built_fused", "loaded_fused"), [(True, False), (False, True)])
def test_the_guard_follows_the_optimiser_groups_after_a_resume(built_fused: bool,
                                                               loaded_fused: bool) -> None:
    """A checkpoint's optimiser groups decide whether Adam steps fused (resuming a CPU run on
    a GPU, or back): the guard defers its check only for a fused step, which takes the flag."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), fused=built_fused or None)
    opt.load_state_dict(torch.optim.Adam(model.parameters(), fused=loaded_fused or None)
                        .state_dict())
    guard = StepGuard(model.named_parameters)
    for step, scale in enumerate([1.0, 1.0, math.inf]):
        opt.zero_grad()
        loss = model(torch.randn(4, 3)).sum() * scale
        loss.backward()
        guard.add_loss(loss, None, 0, step=step, epoch=0)
        if loaded_fused or step < 2:
            guard.check(opt, step=step)  # deferred: the bad step raises at the next check
            opt.step()
        else:
            with pytest.raises(FloatingPointError, match="training loss inf at global step 2"):
                guard.check(opt, step=step)
    if loaded_fused:
        with pytest.raises(FloatingPointError, match="training loss inf at global step 2"):
            guard.flush()


@pytest.mark.parametrize("bound", ["above", "below"])
def test_clipping_on_the_cpu_skips_the_multiply_by_one_and_equals_clip_grad_norm(
        bound: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the norm is within the bound (the coefficient clamps to 1) the gradients are left
    as they are, without a pass over them; past it they are `clip_grad_norm_`'s, to the bit."""
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(5, 4), torch.nn.Linear(5, 4)
    model(torch.randn(8, 5)).pow(2).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    value = 2 * norm if bound == "above" else norm / 3
    torch.nn.utils.clip_grad_norm_(twin.parameters(), value)
    calls = []
    clip = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_",
                        lambda *a, **k: (calls.append(1), clip(*a, **k)))
    opt = torch.optim.Adam(model.parameters())
    guard = StepGuard(model.named_parameters)
    guard.check(opt, step=0)
    guard.clip(opt, value)
    assert len(calls) == (bound == "below")
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))


def _guarded_rank(rank: int, init_file: str, fused: bool, out: str) -> None:
    """One of two gloo ranks: a step whose loss is infinite on rank 0 only, with finite
    gradients everywhere (the gradients alone would let rank 1 go on)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}",
                                         rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.Adam(model.parameters(), fused=fused or None)
        guard = StepGuard(model.named_parameters)
        model(torch.ones(1, 3)).sum().backward()
        guard.add_loss(torch.tensor(math.inf if rank == 0 else 1.0), None, 0, step=7, epoch=0)
        try:
            guard.check(opt, step=7)
            opt.step()  # fused: skipped on the device by the agreed flag
            guard.flush()  # the deferred check's error
        except FloatingPointError as e:
            same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            Path(f"{out}.{rank}").write_text(f"{e!s}\nweights unchanged: {same}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("fused", [False, True])
def test_a_bad_loss_on_one_rank_stops_every_rank(fused: bool, tmp_path: Path) -> None:
    """Under DDP the guard's flag is agreed across the ranks: both stop at the step, each
    saying whose value was bad, and none is left waiting in the next collective."""
    out = str(tmp_path / "error")
    torch.multiprocessing.spawn(_guarded_rank, args=(str(tmp_path / "init"), fused, out),
                                nprocs=2)
    first, second = (Path(f"{out}.{rank}").read_text() for rank in (0, 1))
    assert "training loss inf at global step 7" in first
    assert "on another process at global step 7" in second
    assert first.endswith("weights unchanged: True") and second.endswith("unchanged: True")


def test_a_failed_forward_pass_still_reaches_every_parameter() -> None:
    """The loss a DDP rank returns when its forward pass failed: NaN gradients for every
    trainable parameter (so its backward joins the all-reduce and the check stops all ranks),
    none for frozen ones."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[0].bias.requires_grad_(False)
    from captioning.optim import poisoned_loss

    poisoned_loss(model.parameters()).backward()
    assert model[0].bias.grad is None
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 3 and all(bool(p.grad.isnan().all()) for p in trainable)


def test_a_ddp_rank_whose_forward_failed_joins_the_others_collectives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DDP a rank whose forward pass met NaN returns the poisoned loss, after standing in
    for the collectives its objective's forward would have made (`Objective.stand_in`)."""
    from types import SimpleNamespace

    from captioning.models.captioner import CaptionerConfig

    net = CaptionerConfig(vocab_size=10, backbone="resnet18", weights=None, grid_size=2,
                          embed_dim=8, hidden_dim=8, attn_dim=8, attention="hard")
    module = CaptioningModule(net=net).train()
    module.trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 2))

    def nan_attention(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    stood_in: list[Any] = []
    monkeypatch.setattr(module.captioner.decoder, "forward", nan_attention)
    monkeypatch.setattr(module.objective, "stand_in", stood_in.append)
    batch = SimpleNamespace(images=torch.zeros(2, 4, module.captioner.encoder.dim),
                            captions=torch.ones(2, 4, dtype=torch.long),
                            lengths=torch.tensor([4, 3]), image_ids=["a", "b"])
    loss = module.training_step(batch, 0)
    assert stood_in == [module.captioner] and bool(loss.isnan())


def _scaled_run(fused: bool, shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path
                ) -> tuple[L.Trainer, L.LightningModule, L.LightningDataModule, Any]:
    """A 16-mixed run with gradient clipping whose GradScaler overflows on the first steps."""
    from lightning.pytorch.plugins import MixedPrecision

    L.seed_everything(0)
    dm = runs.make_dm(shapes_dm_kwargs, cache_dir)
    module = runs.make_module(dm)
    module.hparams.fused_adam = fused
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    trainer = runs.make_trainer(tmp_path / "ckpt", max_epochs=1, gradient_clip_val=1.0,
                                plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    return trainer, module, dm, scaler


def test_a_grad_scaler_overflow_skips_the_step_and_training_goes_on(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path) -> None:
    """16-mixed: a GradScaler's overflow is its own to handle (it skips the step and lowers the
    scale), not a reason to stop the run."""
    trainer, module, dm, scaler = _scaled_run(False, shapes_dm_kwargs, cache_dir, tmp_path)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == runs.BATCHES and scaler.get_scale() < 2.0**120


def test_clipping_refuses_a_fused_optimisers_scaled_gradients(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path) -> None:
    """A fused optimiser's gradients are still scaled when clipping would run, so clipping
    refuses them, as Lightning's own does."""
    trainer, module, dm, _ = _scaled_run(True, shapes_dm_kwargs, cache_dir, tmp_path)
    with pytest.raises(RuntimeError, match="clip scaled gradients"):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 0


def test_an_interrupt_while_a_bad_step_is_pending_saves_nothing(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM right after a non-finite step whose check is still on its way (fused Adam):
    the interruption saves no checkpoint, says why, and the weights are as before the step."""
    L.seed_everything(0)
    dm = runs.make_dm(shapes_dm_kwargs, cache_dir)
    module = runs.make_module(dm)
    module.hparams.fused_adam = True
    breaker = runs.BreakAt("inf_grad", batch=1)
    trainer = runs.make_trainer(tmp_path / "ckpt", breaker, runs.InterruptAt("SIGTERM", batch=1),
                                max_epochs=1)
    with pytest.raises(SystemExit), caplog.at_level(logging.WARNING):
        trainer.fit(module, datamodule=dm)
    assert "SIGTERM after a non-finite step: no checkpoint saved" in caplog.text
    assert "non-finite gradient norm at global step 1" in caplog.text
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()
    runs.assert_same(runs.snapshot(module, trainer), breaker.before)


@pytest.mark.parametrize(("clip", "algorithm"), [(0.05, "norm"), (1e6, "norm"),
                                                 (1e-3, "value")])  # every step; never
def test_clipping_reuses_the_checked_norm_and_equals_lightnings(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path, clip: float, algorithm: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's one norm (StepGuard) clips as Lightning's own clip_grad_norm_ (fused Adam,
    the CPU's default, divides by the coefficient's inverse as it reads each gradient: equal to
    float32 rounding), and clipping by value exactly as Lightning's clip_grad_value_."""
    def train(own: bool) -> dict[str, Any]:
        if not own:  # Lightning's clipping through the precision plugin
            monkeypatch.setattr(CaptioningModule, "configure_gradient_clipping",
                                L.LightningModule.configure_gradient_clipping)
        L.seed_everything(0)
        dm = runs.make_dm(shapes_dm_kwargs, cache_dir)
        module = runs.make_module(dm)
        trainer = runs.make_trainer(tmp_path / f"ckpt{own}", max_epochs=1,
                                    gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
        trainer.fit(module, datamodule=dm)
        return runs.snapshot(module, trainer)

    clipped_in_adam = algorithm == "norm" and clip < 1
    runs.assert_same(train(True), train(False), rtol=1e-5 if clipped_in_adam else 0.0,
                     atol=1e-7 if clipped_in_adam else 0.0)


@pytest.mark.parametrize("fused", [True, False])
def test_clipping_by_norm_in_fused_adams_own_pass_equals_clip_grad_norm(fused: bool) -> None:
    """Past the bound, fused Adam takes the clip as `grad_scale` (the coefficient's inverse,
    by which it divides each gradient it reads) instead of a pass of its own: the step, and the
    gradients it leaves, equal clip_grad_norm_'s to float32 rounding. Within the bound there is
    no scale, and the next step starts without the last one's."""
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(5, 4), torch.nn.Linear(5, 4)
    twin.load_state_dict(model.state_dict())
    model(torch.randn(8, 5)).pow(2).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    opt = torch.optim.Adam(model.parameters(), fused=fused or None)
    ref = torch.optim.Adam(twin.parameters())
    guard = StepGuard(model.named_parameters)
    guard.check(opt, step=0)
    guard.clip(opt, norm / 3)
    assert hasattr(opt, "grad_scale") == fused
    torch.nn.utils.clip_grad_norm_(twin.parameters(), norm / 3)
    opt.step()
    ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    guard.check(opt, step=1)
    assert not hasattr(opt, "grad_scale")
    guard.clip(opt, 10 * norm)  # within the bound: nothing to scale
    assert not hasattr(opt, "grad_scale")


def test_a_bad_loss_among_accumulated_batches_is_named(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path) -> None:
    """With gradient accumulation the first of the step's micro-batches has a NaN loss and
    the second is fine: the check before the optimiser step still catches it, and names the
    first (a guard that kept only the latest loss would miss it)."""
    L.seed_everything(0)
    dm = runs.make_dm(shapes_dm_kwargs, cache_dir)
    module = runs.make_module(dm)
    breaker = runs.BreakAt("nan", batch=0)
    trainer = runs.make_trainer(tmp_path / "ckpt", breaker, max_epochs=1,
                                accumulate_grad_batches=2)
    with pytest.raises(FloatingPointError, match=r"training loss nan .*batch 0\)") as info:
        trainer.fit(module, datamodule=dm)
    assert repr(breaker.image_id) in str(info.value)
    runs.assert_same(runs.snapshot(module, trainer), breaker.before)


class StopAfter(L.Callback):
    """Stop the run at the end of optimiser step `steps` (as a time limit would)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.steps:
            trainer.should_stop = True


@pytest.mark.parametrize("stop", [None, 5])
def test_training_logs_only_the_steps_lightning_sends_to_the_loggers(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path, stop: int | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Logging only every `log_every_n_steps` steps writes exactly the rows that logging at
    every step writes, also when a callback stops the run on a step in between."""
    from lightning.pytorch.loggers import CSVLogger

    def metrics(every_step: bool) -> str:
        if every_step:
            monkeypatch.setattr("captioning.train_values.reaches_loggers", lambda *a: True)
        L.seed_everything(0)
        dm = runs.make_dm(shapes_dm_kwargs, cache_dir)
        module = runs.make_module(dm)
        logger = CSVLogger(str(tmp_path / f"logs{every_step}"), name="", version="")
        stops = [StopAfter(stop)] if stop else []
        trainer = runs.make_trainer(tmp_path / f"ckpt{every_step}", *stops, max_epochs=3,
                                    logger=logger, log_every_n_steps=2)
        trainer.fit(module, datamodule=dm)
        return (Path(logger.log_dir) / "metrics.csv").read_text()

    throttled = metrics(False)
    assert throttled == metrics(True)
    rows = list(csv.DictReader(io.StringIO(throttled)))
    logged = [int(r["step"]) for r in rows if r.get("train/loss")]
    # 9 steps (3 epochs of 3 batches): every second one, and the one the run stopped on
    assert logged == ([1, 3, 5, 7] if stop is None else [1, 3, 4])


# ------------------------------------------------------------------------------------------
# Checkpoints


def _leaves(obj: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str | int), f"{where}: key {k!r}"
            yield from _leaves(v, f"{where}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{where}[{i}]")
    else:
        yield where, obj


def test_checkpoint_holds_only_tensors_and_plain_data(fitted: Path) -> None:
    checkpoint = torch.load(fitted, map_location="cpu", weights_only=True)
    plain = (torch.Tensor, int, float, str, bool, type(None))
    odd = [(w, type(v).__name__) for w, v in _leaves(checkpoint) if not isinstance(v, plain)]
    assert not odd
    assert isinstance(checkpoint["captioning_vocab"], dict)
    assert checkpoint["captioning_model_config"]["hidden_dim"] == runs.NET["hidden_dim"]


def test_mismatched_vocabulary_or_config_is_named(fitted: Path, shapes_dm_kwargs: dict,
                                                  cache_dir: Path, tmp_path: Path) -> None:
    dm = runs.make_dm(shapes_dm_kwargs, cache_dir, max_vocab_size=12)  # another vocabulary
    trainer = runs.make_trainer(tmp_path / "a", max_epochs=1)
    with pytest.raises(CheckpointError, match=r"vocabulary \(\d+ words\) is not the data's"):
        trainer.validate(runs.make_module(dm), datamodule=dm, ckpt_path=str(fitted),
                         weights_only=True)
    dm = runs.make_dm(shapes_dm_kwargs, cache_dir)
    trainer = runs.make_trainer(tmp_path / "b", max_epochs=1)
    with pytest.raises(CheckpointError, match=r"do not fit this model.*hidden_dim=32 "
                                              r"\(this model 16\)"):
        trainer.validate(runs.make_module(dm, hidden_dim=16), datamodule=dm, ckpt_path=str(fitted),
                         weights_only=True)
    data = torch.load(fitted, map_location="cpu", weights_only=True)
    del data["captioning_model_config"], data["hyper_parameters"]["net"]
    torch.save(data, tmp_path / "no_config.ckpt")
    with pytest.raises(CheckpointError, match="has no captioning model config"):
        trainer.validate(runs.make_module(dm, hidden_dim=16), datamodule=dm,
                         ckpt_path=str(tmp_path / "no_config.ckpt"), weights_only=True)


def test_decoding_several_captions_keeps_each_image_its_own_best(tmp_path: Path) -> None:
    """With `decode.num_captions` n > 1, validation, test, predict and overlays get one row per
    image, its best beam: what decoding the image alone gives, never a neighbour's n-th beam."""
    from captioning.evaluation import to_results
    from captioning.models.captioner import CaptionerConfig, DecodeConfig
    from captioning.vocab import SPECIALS, Vocabulary

    torch.manual_seed(3)
    net = CaptionerConfig(**{**runs.NET, "vocab_size": 9, "dropout": 0.0})
    module = CaptioningModule(vocab_size=9, net=net, compute_metrics=False,
                              decode=DecodeConfig(strategy="beam", beam_size=3, num_captions=2,
                                                  max_len=6)).eval()
    for p in module.captioner.decoder.parameters():  # spread the beams: distinct captions
        p.data.normal_(0, 1.5)
    feats = torch.randn(3, 4, 512)
    vocab = Vocabulary([*SPECIALS, *(f"w{i}" for i in range(5))])
    with torch.no_grad():
        gen = module.generate(feats)
        alone = [module.generate(feats[i:i + 1]) for i in range(3)]
        both = module.captioner.generate(feats, module.decode)
    assert gen.tokens.size(0) == 3 and both.tokens.size(0) == 6
    res = to_results(gen, vocab, ["a", "b", "c"])
    for i, image_id in enumerate("abc"):
        assert res.hypotheses[image_id] == to_results(alone[i], vocab, [image_id]).hypotheses[
            image_id]
        assert res.scores[image_id] == pytest.approx(float(alone[i].scores[0]), rel=1e-5)
    assert len({tuple(r) for r in both.tokens.tolist()}) > 3  # the beams did differ
    with pytest.raises(ValueError, match="6 decoded rows for 3 images"):
        to_results(both, vocab, ["a", "b", "c"])


def test_only_errors_that_name_nan_or_inf_stop_as_non_finite() -> None:
    """A forward pass that meets NaN stops the run as a non-finite loss does; an error that
    merely contains the letters ("Inference tensors ...") is raised as it is."""
    from captioning.optim import says_non_finite

    with pytest.raises(RuntimeError) as sampling:
        torch.multinomial(torch.tensor([[float("nan"), 1.0]]), 1)
    with torch.inference_mode():
        made = torch.ones(2)
    with pytest.raises(RuntimeError) as inference:
        (made * torch.ones(2, requires_grad=True)).sum().backward()
    assert "inf" in str(inference.value).lower()  # the letters, not the word
    assert says_non_finite(sampling.value) and not says_non_finite(inference.value)
