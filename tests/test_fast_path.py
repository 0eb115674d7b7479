"""The decoder's fast path (`model.fast_path`): teacher forcing over fixed, bucketed shapes, for
torch.compile and CUDA graphs. It must give the eager loop's outputs and gradients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from captioning.checkpoint import upgrade_hparams
from captioning.lit_module import CaptioningModule
from captioning.models import CaptionerConfig, native
from captioning.models.decoder import AttentionLSTMDecoder
from captioning.models.fast_path import resolve_fast_path
from captioning.objectives import MaximumLikelihood

V, D, L = 30, 16, 9
# torch.compile's settings for the fixed-shape pass: room for a graph a bucket (torch 2.14)
COMPILED = {"dynamic": False, "mode": None, "recompile_limit": 64, "isolate_recompiles": True}


def decoder(attention: str = "soft", **kw: Any) -> AttentionLSTMDecoder:
    torch.manual_seed(0)
    return AttentionLSTMDecoder(vocab_size=V, feature_dim=D, embed_dim=12, hidden_dim=20,
                                attn_dim=14, dropout=0.0, attention=attention, **kw)


def batch(lengths: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Features (B, L, D) and captions (B, max+?) in an unsorted order, with trailing pad."""
    g = torch.Generator().manual_seed(1)
    B, width = len(lengths), max(lengths) + 2  # wider than needed, as a padded batch is
    captions = torch.randint(4, V, (B, width), generator=g)
    captions[:, 0] = 1
    for i, n in enumerate(lengths):
        captions[i, n - 1], captions[i, n:] = 2, 0
    return torch.randn(B, L, D, generator=g), captions, torch.tensor(lengths)


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """torch.compile as the identity: the fixed-shape pass runs eagerly, and its settings are
    recorded."""
    calls: list[dict[str, Any]] = []

    def fake(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake)
    yield calls


def loss_and_grads(dec: AttentionLSTMDecoder, feats: Tensor, caps: Tensor, lengths: Tensor,
                   **kw: Any) -> tuple[Any, dict[str, Tensor]]:
    dec.zero_grad()
    out = dec(feats, caps, lengths, **kw)
    batch_ = type("B", (), {"captions": caps, "lengths": lengths})()
    parts = MaximumLikelihood().likelihood(out, batch_)[0]  # type: ignore[arg-type]
    parts["loss"].backward()
    return out, {n: p.grad.clone() for n, p in dec.named_parameters() if p.grad is not None}


def assert_same(dec: AttentionLSTMDecoder, a: tuple[Any, dict[str, Tensor]],
                b: tuple[Any, dict[str, Tensor]]) -> None:
    """Eager `a` and fixed-shape `b` of `dec`: the same outputs on the eager T steps (the fixed
    pass runs as many steps as the captions are wide, the rest masked) and the same gradients,
    one for every trainable parameter of the decoder."""
    (out_a, grads_a), (out_b, grads_b) = a, b
    T = out_a.logits.size(1)
    torch.testing.assert_close(out_b.logits[:, :T], out_a.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_b.alphas[:, :T], out_a.alphas, atol=1e-5, rtol=1e-5)
    assert (out_b.alphas[:, T:] == 0).all()
    trainable = {n for n, p in dec.named_parameters() if p.requires_grad}
    assert trainable and set(grads_a) == trainable and set(grads_b) == trainable
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("attention", "rule"), [("soft", None), ("hard", "expected"),
                                                 ("hard", "argmax")])
@pytest.mark.parametrize("bucket", [1, 4, 8])
def test_fixed_shape_pass_equals_the_eager_loop(eager_compile: list[dict[str, Any]],
                                                attention: str, rule: str | None,
                                                bucket: int) -> None:
    feats, caps, lengths = batch([4, 7, 2, 7, 5, 3])  # unsorted; 6 predicted words at most
    dec = decoder(attention)
    kw = {} if rule is None else {"rule": rule}
    eager = loss_and_grads(dec, feats, caps, lengths, **kw)
    dec.use_fast_path("compile", bucket=bucket)
    fixed = loss_and_grads(dec, feats, caps, lengths, **kw)
    assert_same(dec, eager, fixed)
    assert eager_compile == [COMPILED]
    assert eager[0].logits.shape == (6, 6, V)
    assert fixed[0].logits.shape == (6, caps.size(1) - 1, V)  # cut back to the captions' width
    assert (fixed[0].alphas[2, 1:] == 0).all()  # zero past the end, as in the eager loop
    # Every parameter gets its gradient through the fixed pass (score, gate, LSTM, init, out).
    assert set(fixed[1]) == {n for n, _ in dec.named_parameters()}


def test_sampled_rules_mask_the_padding_steps(eager_compile: list[dict[str, Any]]) -> None:
    """Hard attention trained by sampling (REINFORCE, Gumbel): log p(s_t) and H[α_t] are zero
    past each caption's end, and each caption says whether it was sampled."""
    feats, caps, lengths = batch([4, 7, 2, 5])
    for estimator in ("reinforce", "gumbel"):
        dec = decoder("hard", hard_estimator=estimator, semi_sampling_prob=0.5)
        dec.use_fast_path("compile", bucket=8)
        dec.train()
        out = dec(feats, caps, lengths)
        assert out.attn_log_probs is not None and out.attn_entropy is not None
        T = caps.size(1) - 1
        assert out.attn_log_probs.shape == (4, T) and out.sampled is not None
        steps = (lengths - 1).unsqueeze(1)
        past = torch.arange(T).unsqueeze(0) >= steps
        assert (out.attn_log_probs[past] == 0).all() and (out.attn_entropy[past] == 0).all()
        assert (out.attn_entropy[~past] > 0).all()
        torch.testing.assert_close(out.alphas.sum(-1)[~past], torch.ones(int((~past).sum())))
        assert (out.alphas[past] == 0).all()


def test_compiled_pass_equals_the_eager_loop_on_the_cpu() -> None:
    """The real torch.compile (Inductor, CPU): the same loss and gradients as the eager loop."""
    feats, caps, lengths = batch([4, 6, 3])
    dec = decoder("soft")
    eager = loss_and_grads(dec, feats, caps, lengths)
    dec.use_fast_path("compile", bucket=4)
    compiled = loss_and_grads(dec, feats, caps, lengths)
    assert_same(dec, eager, compiled)
    again = loss_and_grads(dec, feats, caps, lengths)  # the cached graph, run again
    assert_same(dec, eager, again)


def test_one_compile_covers_a_bucket_whatever_the_batchs_width(counted_compile: Any) -> None:
    """Batches of one bucket compile once: captions cut from a wider batch (other strides)
    and captions padded up to the bucket reach the compiled pass alike."""
    dec = decoder("soft")
    dec.use_fast_path("compile", bucket=4)
    for lengths in ([5, 3], [6, 3], [7, 3]):  # widths 7, 8, 9: 6, 7, 8 steps, one bucket
        loss_and_grads(dec, *batch(lengths))
    assert counted_compile.frame_count == 1


def test_a_smaller_batch_replays_its_buckets_graph(counted_compile: Any) -> None:
    """An epoch's smaller last batch runs at the most rows seen, the extra rows masked: no
    compile of its own, and the eager loop's outputs and gradients for its own rows."""
    counter = counted_compile
    dec = decoder("soft")
    small = batch([6, 3, 5])
    eager = loss_and_grads(dec, *small)
    dec.use_fast_path("compile", bucket=8)
    loss_and_grads(dec, *batch([4, 7, 2, 7, 5, 3]))  # a full batch: 6 rows
    fixed = loss_and_grads(dec, *small)  # 3 rows, run as 6
    assert counter.frame_count == 1
    assert fixed[0].logits.shape[0] == 3
    assert_same(dec, eager, fixed)
    dec.eval()  # validation's loss: without gradient, the eager loop, nothing compiled
    with torch.no_grad():
        torch.testing.assert_close(dec(*small).logits, eager[0].logits)
    assert counter.frame_count == 1
    # Hard attention, one semi-sampling coin a batch: the coin, expanded over a full batch,
    # reaches the pass as a padded one does (strides too): still one graph.
    torch._dynamo.reset()
    counter.frame_count = 0
    dec = decoder("hard", semi_sampling="batch", semi_sampling_prob=0.5)
    dec.use_fast_path("compile", bucket=8)
    for lengths in ([4, 7, 2, 7, 5, 3], [6, 3, 5]):
        loss_and_grads(dec, *batch(lengths))
    assert counter.frame_count == 1


def test_every_bucket_keeps_its_compiled_graph(counted_compile: Any) -> None:
    """More buckets than dynamo's default recompile limit (8 a function) all stay compiled:
    past it they would run eagerly."""
    dec = decoder("soft")
    dec.use_fast_path("compile", bucket=2)
    for n in range(3, 24, 2):  # 11 buckets
        loss_and_grads(dec, *batch([n, 3]))
    assert counted_compile.frame_count == 11 > torch.compiler.config.recompile_limit


def test_a_fit_on_the_fast_path_compiles_a_graph_a_bucket(
        shapes_dm_kwargs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        counted_compile: Any) -> None:
    """The GPU test's fit (`test_gpu.check_fit_on_the_fast_path`) on the CPU, compiled: one
    graph for each bucket it met, the smaller last batch adding none."""
    from test_gpu import check_fit_on_the_fast_path

    calls = check_fit_on_the_fast_path("cpu", "compile", "32-true", 4, shapes_dm_kwargs,
                                       tmp_path, monkeypatch)
    assert counted_compile.frame_count == len(set(calls)) > 1


def test_fast_path_settings() -> None:
    assert resolve_fast_path("auto", torch.device("cuda")) == "graphs"
    assert resolve_fast_path("auto", torch.device("cuda"), "hard") == "off"
    assert resolve_fast_path("auto", torch.device("cpu")) == "native"
    assert resolve_fast_path("auto", torch.device("mps")) == "off"
    assert resolve_fast_path("compile", torch.device("cpu")) == "compile"
    with pytest.raises(ValueError,
                       match="fast_path must be 'auto', 'off', 'native', 'compile' or 'graphs'"):
        resolve_fast_path("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="bucket must be >= 1"):
        decoder().use_fast_path("compile", bucket=0)
    # Checkpoints from before the fast path: `compile: true` meant compiling the step.
    assert upgrade_hparams({"compile": True})["fast_path"] == "compile"
    assert upgrade_hparams({"compile": False})["fast_path"] == "auto"
    assert "compile" not in upgrade_hparams({"compile": True})


def test_the_module_sets_the_fast_path_up_once(eager_compile: list[dict[str, Any]]) -> None:
    net = CaptionerConfig(vocab_size=10, backbone="resnet18", weights=None, grid_size=2,
                          embed_dim=8, hidden_dim=8, attn_dim=8)
    module = CaptioningModule(net=net)  # auto: the native kernel on the CPU, nothing compiled
    module.setup("fit")
    built = native.available()  # False only where no C++ compiler can build it: then `off`
    assert module.captioner.decoder.fast_path == ("native" if built else "off")
    assert module.captioner.decoder.attention.native == built and not eager_compile
    module = CaptioningModule(net=net, fast_path="compile", fast_bucket=4)
    module.setup("fit")
    module.setup("validate")  # once only
    assert eager_compile == [COMPILED]
    assert module.captioner.decoder.fast_bucket == 4


def test_gradients_summed_over_batches_take_compile_not_graphs(
        eager_compile: list[dict[str, Any]]) -> None:
    """A parameter's first gradient of a CUDA-graph pass is the graph's output itself, which
    the next batch's replay overwrites (pytorch/pytorch#169545): where a trainer accumulates
    gradients over batches, `graphs` (asked for, or `auto` on CUDA) runs as `compile`."""
    import lightning.pytorch as L

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_fast_path("auto", cuda, accumulate=2) == "compile"
    assert resolve_fast_path("graphs", cpu, accumulate=4) == "compile"
    assert resolve_fast_path("graphs", cuda, accumulate=1) == "graphs"
    assert resolve_fast_path("auto", cpu, accumulate=2) == "native"
    assert resolve_fast_path("auto", cuda, "hard", accumulate=2) == "off"
    net = CaptionerConfig(vocab_size=10, backbone="resnet18", weights=None, grid_size=2,
                          embed_dim=8, hidden_dim=8, attn_dim=8)
    for accumulate, mode in ((2, None), (1, "reduce-overhead")):
        module = CaptioningModule(net=net, fast_path="graphs")
        module.trainer = L.Trainer(accelerator="cpu", accumulate_grad_batches=accumulate,
                                   logger=False, enable_checkpointing=False)
        module.setup("fit")
        assert module.captioner.decoder.fast_path == ("compile" if mode is None else "graphs")
        assert eager_compile.pop()["mode"] == mode


@pytest.mark.parametrize("kw", [{"output_tanh": True}, {"normalizer": "sparsemax"}])
def test_the_model_options_take_every_path_alike(eager_compile: list[dict[str, Any]],
                                                 kw: dict[str, Any]) -> None:
    """capgen.py's tanh on the deep output and sparsemax attention: the fixed-shape and native
    passes equal the eager loop, and the step API's logits equal the teacher-forced ones."""
    feats, caps, lengths = batch([4, 7, 2, 7, 5, 3])
    dec = decoder(**kw)
    eager = loss_and_grads(dec, feats, caps, lengths)
    for mode in ("compile", "native"):
        dec.use_fast_path(mode)
        assert_same(dec, eager, loss_and_grads(dec, feats, caps, lengths))
    dec.use_fast_path("off")
    with torch.no_grad():  # one word at a time, as decoding runs
        memory = dec.memory(feats)
        state = dec.init_state(memory)
        for t in range(3):
            log_probs, state, alpha = dec.step(caps[:, t], state, memory)
            live = lengths - 1 > t
            torch.testing.assert_close(log_probs[live],
                                       eager[0].logits[live, t].log_softmax(-1))
            torch.testing.assert_close(alpha[live], eager[0].alphas[live, t])
    if kw.get("output_tanh"):  # L_o(tanh(E y + L_h h + L_z ẑ)): the tanh changes the logits
        dec.output_tanh = False
        assert not torch.allclose(dec(feats, caps, lengths).logits, eager[0].logits)
