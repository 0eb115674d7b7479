"""Attention as a research axis: score functions, Gumbel-softmax straight-through hard attention,
the paper's semi-sampling gradient, capgen.py's deeper MLPs, the reward form, and the baselines
under DDP and in validation."""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from tiny_runs import BATCHES, cli_config, make_dm
from torch import Tensor

from captioning.callbacks import GumbelTemperature
from captioning.checkpoint import CheckpointError, load_checkpoint, read_checkpoint
from captioning.cli import main
from captioning.lit_module import CaptioningModule
from captioning.losses import target_mask
from captioning.models import Captioner, CaptionerConfig, DecodeConfig
from captioning.models.attention import (
    SCORERS,
    AdditiveAttention,
    GumbelSchedule,
    build_scorer,
    sample_gumbel,
    select,
    sparsemax,
)
from captioning.models.packing import PackedSteps
from captioning.objectives import (
    GumbelStraightThrough,
    MaximumLikelihood,
    Reinforce,
    TokenReinforce,
    build_objective,
)

V, L_LOC, D = 12, 4, 512  # vocabulary, locations, annotation size (resnet18 without a grid)
START, END = 1, 2
SCORES = sorted(SCORERS)
OLD_CKPT = Path(__file__).resolve().parent / "data" / "main_v1" / "hard_token.ckpt"
#: (attention, hard_estimator) of every training mode
MODES = [("soft", "reinforce"), ("hard", "reinforce"), ("hard", "gumbel")]


def captioner(**net: Any) -> Captioner:
    cfg = dict(vocab_size=V, backbone="resnet18", weights=None, grid_size=None, embed_dim=16,
               hidden_dim=24, attn_dim=16, dropout=0.0)
    return Captioner(CaptionerConfig(**{**cfg, **net}))


def batch(seed: int = 0, B: int = 6) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(1, 5, (B,), generator=g)
    words[0] = 5
    caps = torch.zeros(B, 7, dtype=torch.long)
    for i, n in enumerate(words.tolist()):
        caps[i, : n + 2] = torch.tensor([START, *torch.randint(4, V, (n,), generator=g).tolist(),
                                         END])
    return SimpleNamespace(captions=caps, lengths=words + 2,
                           images=torch.randn(B, L_LOC, D, generator=g))


def nonzero_grads(module: torch.nn.Module) -> dict[str, bool]:
    return {n: p.grad is not None and bool(p.grad.abs().gt(0).any())
            for n, p in module.named_parameters()}


# -- score functions ----------------------------------------------------------------------------
@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize(("attention", "estimator"), MODES)
@pytest.mark.parametrize("score", SCORES)
def test_every_score_gives_a_distribution_and_trains_every_parameter(
        score: str, attention: str, estimator: str, n_layers: int) -> None:
    torch.manual_seed(0)
    model = captioner(score=score, attention=attention, hard_estimator=estimator,
                      n_layers_att=n_layers, n_layers_init=n_layers).train()
    objective = build_objective(attention=attention, hard_estimator=estimator, vocab_size=V)
    b = batch(1)
    out = model.decoder(b.images, b.captions, b.lengths)
    mask = target_mask(b.lengths, out.alphas.size(1))
    alphas = out.alphas[mask]  # (real steps, L)
    assert bool((alphas >= 0).all())
    torch.testing.assert_close(alphas.sum(-1), torch.ones(len(alphas)))
    objective(model, b.images, b)["loss"].backward()
    grads = nonzero_grads(model.decoder.attention)
    assert grads and all(grads.values()), grads  # every scorer parameter learns
    assert len(grads) == {"additive": 4, "dot": 2, "scaled_dot": 2, "general": 1}[score] \
        + 2 * (n_layers - 1)  # the deeper attention adds W_att_1, b_att_1 (capgen.py)
    assert all(nonzero_grads(model.decoder).values())


@pytest.mark.parametrize("fast_path", ["off", "native"])
@pytest.mark.parametrize("score", SCORES)
def test_a_pass_sums_the_query_weights_gradient_once_as_autograd_would(
        score: str, fast_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A teacher-forced pass multiplies by W_q through its `query_product`, which forms W_q's
    gradient once; every gradient equals the one of the query layer called each step. Decoding
    steps call the layer."""
    torch.manual_seed(0)
    model = captioner(score=score).train()
    model.decoder.use_fast_path(fast_path)
    if model.decoder.fast_path != fast_path:  # only the additive score has native kernels
        pytest.skip(f"no native path for the {score} score (or no kernels built here)")
    b = batch(2)
    scorer = model.decoder.attention
    assert (scorer.query_product() is None) == (score == "general")

    def grads() -> dict[str, Tensor]:
        model.zero_grad(set_to_none=True)
        out = model.decoder(b.images, b.captions, b.lengths)
        (out.logits.square().mean() + out.alphas.square().sum()).backward()
        return {n: p.grad.clone() for n, p in model.decoder.named_parameters()}

    calls: list[int] = []
    if score != "general":
        scorer.query.register_forward_hook(lambda *args: calls.append(1))
    summed = grads()
    assert not calls  # the pass did not step the layer
    with torch.no_grad():
        memory = model.decoder.memory(b.images)
        model.decoder.step(b.captions[:, 0], model.decoder.init_state(memory), memory)
    assert calls or score == "general"  # a decoding step did
    calls.clear()
    monkeypatch.setattr(type(scorer), "query_product", lambda self, **kw: None)
    plain = grads()
    assert calls or score == "general"
    assert summed.keys() == plain.keys()
    for name in summed:
        torch.testing.assert_close(summed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("score", SCORES)
def test_scorers_project_the_grid_once_and_score_every_location(score: str) -> None:
    torch.manual_seed(1)
    scorer = build_scorer(score, feature_dim=8, hidden_dim=6, attn_dim=5)
    feats, h = torch.randn(3, 7, 8), torch.randn(3, 6)
    keys = scorer.project(feats)
    assert keys.shape == (3, 7, 6 if score == "general" else 5)
    e = scorer(keys, h)
    assert e.shape == (3, 7)
    if score == "general":  # h^T W a, by hand
        torch.testing.assert_close(e, torch.einsum("bh,hd,bld->bl", h, scorer.key.weight, feats))
    if score in ("dot", "scaled_dot"):
        by_hand = torch.einsum("bla,ba->bl", feats @ scorer.key.weight.T,
                               h @ scorer.query.weight.T)
        scale = 1 / math.sqrt(5) if score == "scaled_dot" else 1.0
        torch.testing.assert_close(e, by_hand * scale)
    with pytest.raises(ValueError, match="score must be one of"):
        build_scorer("cosine", feature_dim=8, hidden_dim=6, attn_dim=5)


@pytest.mark.parametrize(("attention", "hard_decode"),
                         [("soft", "expected"), ("hard", "expected"), ("hard", "argmax")])
@pytest.mark.parametrize("score", SCORES)
def test_beam_search_with_every_score(score: str, attention: str, hard_decode: str) -> None:
    """Beam search expands the memory (keys of any width) once and reorders only the states:
    each beam's score is the teacher-forced log-likelihood of its words, and beam size 1 is
    greedy search."""
    torch.manual_seed(2)
    model = captioner(score=score, attention=attention, hard_decode=hard_decode,
                      n_layers_att=2).eval()
    feats = torch.randn(3, L_LOC, D)
    with torch.no_grad():
        gen = model.generate(feats, DecodeConfig(beam_size=3, max_len=6))
        greedy = model.generate(feats, DecodeConfig(strategy="greedy", max_len=6))
        one = model.generate(feats, DecodeConfig(beam_size=1, max_len=6))
        assert torch.equal(one.tokens, greedy.tokens)
        n = gen.lengths
        caps = torch.cat([torch.full((3, 1), START), gen.tokens], dim=1)
        out = model.decoder(feats, caps, n + 1)  # teacher-forced, the same decoding rule
        logp = F.log_softmax(out.logits, -1).gather(-1, gen.tokens[:, : out.logits.size(1),
                                                                   None])[..., 0]
        rescored = (logp * target_mask(n + 1, logp.size(1))).sum(1)
    torch.testing.assert_close(rescored, gen.scores, atol=1e-4, rtol=1e-4)
    emitted = target_mask(n + 1, gen.alphas.size(1))
    torch.testing.assert_close(gen.alphas[emitted].sum(-1), torch.ones(int(emitted.sum())))


# -- sparsemax -----------------------------------------------------------------------------------
def test_sparsemax_projects_onto_the_simplex_with_its_known_jacobian() -> None:
    """α = max(e − τ, 0) sums to one with exact zeros; ties and a dominant score give the
    uniform and the one-hot α; the gradient is δ_ij − 1/|S| on the support S, 0 off it."""
    torch.testing.assert_close(sparsemax(torch.tensor([[1.0, 0.8, 0.1, -1.0]])),
                               torch.tensor([[0.6, 0.4, 0.0, 0.0]]))
    assert torch.equal(sparsemax(torch.zeros(1, 4)), torch.full((1, 4), 0.25))
    assert torch.equal(sparsemax(torch.tensor([[3.0, 0.0, 0.0]])), torch.tensor([[1.0, 0, 0]]))
    for offset in (1e3, 1e6, 1e8):  # shift-invariant: large scores neither crash nor drift
        torch.testing.assert_close(sparsemax(torch.tensor([[1.0, 0.8, 0.1, -1.0]]) + offset)
                                   .sum(-1), torch.ones(1))
    assert torch.equal(sparsemax(torch.tensor([[1e8, 1e8, 0.0]])), torch.tensor([[0.5, 0.5, 0]]))
    bad = sparsemax(torch.tensor([[math.nan, 1.0, 0.0], [math.inf, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert bool(bad[:2].isnan().all()) and torch.equal(bad[2], torch.tensor([1.0, 0, 0]))
    torch.manual_seed(4)
    e = torch.randn(5, 9) * 2
    a = sparsemax(e)
    torch.testing.assert_close(a.sum(-1), torch.ones(5))
    assert bool((a >= 0).all()) and bool((a == 0).any())
    for row in range(5):
        jac = torch.autograd.functional.jacobian(lambda x: sparsemax(x[None])[0], e[row])
        support = (a[row] > 0).float()
        want = (torch.diag(support) - torch.outer(support, support) / support.sum())
        torch.testing.assert_close(jac, want)


@pytest.mark.parametrize("fast_path", ["off", "native"])
def test_sparsemax_attention_trains_and_decodes(fast_path: str) -> None:
    """`normalizer: sparsemax` (soft attention): the teacher-forced α are sparse
    distributions, every parameter learns, and beam search rescoring matches the pass; hard
    attention refuses it."""
    torch.manual_seed(5)
    model = captioner(normalizer="sparsemax", attn_dim=16).train()
    model.decoder.use_fast_path(fast_path)
    b = batch(2)
    out = model.decoder(b.images, b.captions, b.lengths)
    alphas = out.alphas[target_mask(b.lengths, out.alphas.size(1))]
    torch.testing.assert_close(alphas.sum(-1), torch.ones(len(alphas)))
    assert bool((alphas == 0).any())  # sparse: some locations get exactly nothing
    MaximumLikelihood()(model, b.images, b)["loss"].backward()
    assert all(nonzero_grads(model.decoder).values())
    model.eval()
    with torch.no_grad():
        gen = model.generate(b.images[:3], DecodeConfig(beam_size=3, max_len=6))
        caps = torch.cat([torch.full((3, 1), START), gen.tokens], dim=1)
        teacher = model.decoder(b.images[:3], caps, gen.lengths + 1)
        logp = F.log_softmax(teacher.logits, -1).gather(
            -1, gen.tokens[:, : teacher.logits.size(1), None])[..., 0]
    rescored = (logp * target_mask(gen.lengths + 1, logp.size(1))).sum(1)
    torch.testing.assert_close(rescored, gen.scores, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="normalizer 'sparsemax' is for soft attention"):
        captioner(normalizer="sparsemax", attention="hard")
    for rule in ("sample", "gumbel", "argmax"):  # the one select() refuses it too
        with pytest.raises(ValueError, match="is for soft attention"):
            select(torch.zeros(2, 4), rule, normalizer="sparsemax")


# -- Gumbel-softmax straight-through ------------------------------------------------------------
def test_gumbel_forward_is_one_hot_and_backward_is_the_relaxed_sample_gradient() -> None:
    torch.manual_seed(3)
    scores = torch.randn(5, 9, requires_grad=True)
    noise = sample_gumbel(scores.detach())
    tau = 0.7
    sel = select(scores, "gumbel", tau=tau, noise=noise)
    log_alpha = F.log_softmax(scores.detach(), -1)
    loc = (log_alpha + noise).argmax(-1)
    assert torch.equal(sel.location, loc)
    assert torch.equal(sel.weights, F.one_hot(loc, 9).float())  # exactly one-hot
    upstream = torch.randn(5, 9)
    (sel.weights * upstream).sum().backward()
    st_grad = scores.grad.clone()
    # autograd's gradient of the relaxed sample softmax((log α + g) / τ), for the same noise
    relaxed_scores = scores.detach().clone().requires_grad_(True)
    relaxed = F.softmax((F.log_softmax(relaxed_scores, -1) + noise) / tau, -1)
    (relaxed * upstream).sum().backward()
    torch.testing.assert_close(st_grad, relaxed_scores.grad)
    assert bool(st_grad.abs().gt(0).any())
    torch.testing.assert_close(sel.log_prob, log_alpha.gather(1, loc[:, None])[:, 0])
    assert bool((sel.entropy > 0).all())


def test_gumbel_context_is_exactly_a_grid_vector() -> None:
    torch.manual_seed(4)
    model = captioner(attention="hard", hard_estimator="gumbel", semi_sampling_prob=0.0).train()
    dec = model.decoder
    with torch.no_grad():  # β = σ(f_β(h)) = 1 exactly, so ẑ_t = z_t
        dec.gate.weight.zero_()
        dec.gate.bias.fill_(40.0)
    contexts: list[Tensor] = []
    dec.out_z.register_forward_hook(lambda m, inp, out: contexts.append(inp[0].detach()))
    b = batch(4)
    order = torch.argsort(b.lengths, descending=True, stable=True)  # as the decoder runs it
    b = SimpleNamespace(images=b.images[order], captions=b.captions[order],
                        lengths=b.lengths[order])
    out = dec(b.images, b.captions, b.lengths)
    assert bool(out.sampled.all())
    (z,) = contexts  # (N, D): every real word position's context, packed, in one call
    pk = PackedSteps.of((b.lengths - 1).tolist(), device=z.device)
    assert z.size(0) == len(pk.index) == int((b.lengths - 1).sum())
    for row, position in enumerate(pk.index.tolist()):
        i = position // pk.steps  # the caption of this packed row
        matches = (b.images[i] == z[row]).all(-1)  # which grid vectors equal it, bit for bit
        assert int(matches.sum()) == 1, (i, position)


def test_gumbel_likelihood_trains_the_scorer_through_the_sample() -> None:
    """Unlike REINFORCE, the likelihood of sampled captions reaches the scorer."""
    torch.manual_seed(5)
    for estimator, reaches in (("gumbel", True), ("reinforce", False)):
        model = captioner(attention="hard", hard_estimator=estimator,
                          semi_sampling_prob=0.0).train()
        b = batch(5)
        parts = MaximumLikelihood(doubly_stochastic=0.0)(model, b.images, b)
        parts["loss"].backward()
        assert any(nonzero_grads(model.decoder.attention).values()) == reaches, estimator


def test_gumbel_objective_has_no_reinforce_terms_and_an_optional_entropy() -> None:
    torch.manual_seed(6)
    model = captioner(attention="hard", hard_estimator="gumbel").train()
    objective = build_objective(attention="hard", hard_estimator="gumbel", advantage="token",
                                vocab_size=V, entropy_weight=0.0, reward_scale=1.0)
    assert type(objective) is GumbelStraightThrough and not list(objective.buffers())
    b = batch(6)
    torch.manual_seed(7)
    parts = objective(model, b.images, b)
    assert set(parts) == {"loss", "nll", "nll_per_word", "doubly_stochastic", "attn_entropy"}
    torch.testing.assert_close(parts["loss"], parts["nll"] + parts["doubly_stochastic"])
    objective.entropy_weight = 0.5
    torch.manual_seed(7)
    with_entropy = objective(model, b.images, b)
    mean_steps = target_mask(b.lengths, 6).sum(1).float().mean()
    torch.testing.assert_close(with_entropy["loss"], parts["loss"]
                               - 0.5 * parts["attn_entropy"] * mean_steps)
    with pytest.raises(ValueError, match="hard_estimator must be one of"):
        build_objective(attention="hard", hard_estimator="straight")
    with pytest.raises(ValueError, match="hard_estimator"):
        captioner(attention="hard", hard_estimator="straight")


@pytest.mark.parametrize("decode", ["expected", "argmax", "sample"])
def test_gumbel_model_decodes_by_the_hard_rules(decode: str) -> None:
    torch.manual_seed(8)
    gumbel = captioner(attention="hard", hard_estimator="gumbel", hard_decode=decode).eval()
    reinforce = captioner(attention="hard", hard_decode=decode).eval()
    reinforce.load_state_dict(gumbel.state_dict())  # the estimators share every parameter
    feats = torch.randn(2, L_LOC, D)
    torch.manual_seed(9)
    a = gumbel.generate(feats, DecodeConfig(strategy="greedy", max_len=5))
    torch.manual_seed(9)
    b = reinforce.generate(feats, DecodeConfig(strategy="greedy", max_len=5))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.locations, b.locations)


@pytest.mark.parametrize("anneal", ["linear", "exponential", "constant"])
def test_tau_schedule_runs_from_start_to_end(anneal: str) -> None:
    s = GumbelSchedule(start=2.0, end=0.25, anneal=anneal)
    taus = [s.tau(step, 100) for step in range(0, 201, 10)]
    assert taus[0] == 2.0
    if anneal == "constant":
        assert set(taus) == {2.0}
        return
    assert taus[10] == pytest.approx(0.25) and taus[-1] == pytest.approx(0.25)  # then stays
    assert all(a > b for a, b in itertools.pairwise(taus[:11]))
    middle = {"linear": 1.125, "exponential": math.sqrt(2.0 * 0.25)}[anneal]
    assert s.tau(50, 100) == pytest.approx(middle)
    fixed = GumbelSchedule(start=2.0, end=0.25, anneal=anneal, steps=10)  # not the run's length
    assert fixed.tau(10, 1000) == pytest.approx(0.25) and fixed.tau(0, 1000) == 2.0
    assert s.tau(5, 0) == 2.0  # no known length: τ stays at its start
    for bad in ({"start": 0.0}, {"end": -1.0}, {"anneal": "cosine"}, {"steps": -1}):
        with pytest.raises(ValueError):
            GumbelSchedule(**bad)


def test_tau_callback_sets_tau_from_the_trainer_step() -> None:
    module = CaptioningModule(net=CaptionerConfig(
        vocab_size=V, backbone="resnet18", weights=None, grid_size=None, embed_dim=8,
        hidden_dim=8, attn_dim=8, attention="hard", hard_estimator="gumbel",
        gumbel_tau_start=1.5, gumbel_tau_end=0.5, gumbel_anneal="linear", gumbel_anneal_steps=4))
    assert any(isinstance(c, GumbelTemperature) for c in module.configure_callbacks())
    logged: list[float] = []
    module.log = lambda name, value, **kw: logged.append(value)  # type: ignore[method-assign]
    callback = GumbelTemperature()
    for step in (0, 2, 4, 9):
        trainer = SimpleNamespace(global_step=step, estimated_stepping_batches=100)
        callback.on_train_batch_start(trainer, module, None, 0)  # type: ignore[arg-type]
    assert logged == pytest.approx([1.5, 1.0, 0.5, 0.5])
    assert module.captioner.decoder.tau.item() == pytest.approx(0.5)
    assert "captioner.decoder.tau" not in module.state_dict()  # set each step, never saved


# -- the semi-sampling gradient ----------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["reinforce", "gumbel"])
@pytest.mark.parametrize("score", SCORES)
def test_semi_sampled_likelihood_trains_the_scorer(score: str, estimator: str) -> None:
    """Every caption uses the expected context: with the paper's gradient (the default) its
    likelihood trains the scorer, with `detached` it does not."""
    for grad, reaches in (("paper", True), ("detached", False)):
        torch.manual_seed(10)
        model = captioner(attention="hard", hard_estimator=estimator, score=score,
                          semi_sampling_prob=1.0, semi_sampling_grad=grad).train()
        b = batch(10)
        out = model.decoder(b.images, b.captions, b.lengths)
        assert not bool(out.sampled.any())
        logits, T = out.logits, out.logits.size(1)
        ll = F.log_softmax(logits, -1).gather(-1, b.captions[:, 1 : T + 1, None])[..., 0]
        (-(ll * target_mask(b.lengths, T)).sum()).backward()
        grads = nonzero_grads(model.decoder.attention)
        assert (all(grads.values()) if reaches else not any(grads.values())), (grad, grads)
    assert CaptionerConfig().semi_sampling_grad == "paper"


# -- capgen.py's deeper attention and init MLPs --------------------------------------------------
def test_deeper_attention_and_init_follow_capgen() -> None:
    torch.manual_seed(11)
    model = captioner(n_layers_att=2, n_layers_init=2, dropout=0.0).eval()
    dec = model.decoder
    att = dec.attention
    assert isinstance(att, AdditiveAttention)
    feats, h = torch.randn(2, L_LOC, D), torch.randn(2, 24)
    lin = att.deep[0]
    # pctx = tanh(W_att_1 (W_c a + b) + b_att_1), then w^T tanh(pctx + W_d h)
    keys = torch.tanh(lin(att.key(feats)))
    torch.testing.assert_close(att.project(feats), keys)
    torch.testing.assert_close(att(att.project(feats), h),
                               att.score(torch.tanh(keys + att.query(h)[:, None]))[..., 0])
    # ctx_mean -> ReLU(ff_init_1) -> tanh(ff_state), tanh(ff_memory): one shared extra layer
    state = dec.init_state(dec.memory(feats))
    mean = torch.relu(dec.init_trunk[0](feats.mean(1)))
    torch.testing.assert_close(state.h, torch.tanh(dec.init_h(mean)))
    torch.testing.assert_close(state.c, torch.tanh(dec.init_c(mean)))
    for bad in ({"n_layers_att": 0}, {"n_layers_init": 0}):
        with pytest.raises(ValueError, match="n_layers"):
            captioner(**bad)


# -- old checkpoints ------------------------------------------------------------------------------
def test_old_checkpoints_read_as_the_additive_single_layer_network() -> None:
    raw = read_checkpoint(OLD_CKPT)["captioning_model_config"]
    new = {"score", "n_layers_att", "n_layers_init", "hard_estimator", "semi_sampling_grad",
           "gumbel_tau_start", "gumbel_tau_end", "gumbel_anneal", "gumbel_anneal_steps"}
    assert not new & set(raw)  # written before these fields existed
    model = load_checkpoint(OLD_CKPT)  # strict: the state dict fits the rebuilt network exactly
    cfg = model.config
    assert (cfg.score, cfg.n_layers_att, cfg.n_layers_init, cfg.hard_estimator) == \
        ("additive", 1, 1, "reinforce")
    assert isinstance(model.captioner.decoder.attention, AdditiveAttention)
    names = {k for k in model.captioner.state_dict() if k.startswith("decoder.")}
    assert {"decoder.attention.key.weight", "decoder.attention.query.weight",
            "decoder.attention.score.weight"} <= names
    assert not any("deep" in k or "init_trunk" in k for k in names)


# -- the reward form --------------------------------------------------------------------------------
@pytest.mark.parametrize("advantage", ["sequence", "token", "expected"])
def test_mean_reward_is_the_sum_per_word(advantage: str) -> None:
    torch.manual_seed(12)
    model = captioner(attention="hard", semi_sampling_prob=0.0).train()
    b = batch(12)
    words = (b.lengths - 1).float()
    rewards = {}
    for form in ("sum", "mean"):
        objective = build_objective(attention="hard", advantage=advantage, vocab_size=V,
                                    reward=form)
        assert objective.reward_form == form
        torch.manual_seed(13)
        out = model.decoder(b.images, b.captions, b.lengths)
        T = out.logits.size(1)
        mask = target_mask(b.lengths, T)
        word_ll = F.log_softmax(out.logits, -1).gather(-1, b.captions[:, 1 : T + 1, None])[..., 0]
        word_ll = word_ll * mask
        rewards[form] = objective.reward_and_baseline(model, b.images, b, word_ll, mask, None)
    (r_sum, b_sum), (r_mean, b_mean) = rewards["sum"], rewards["mean"]
    per = words if r_sum.dim() == 1 else words[:, None]
    torch.testing.assert_close(r_mean, r_sum / per)
    if advantage != "sequence":  # a per-caption baseline follows the same form
        torch.testing.assert_close(b_mean, b_sum / per)
    with pytest.raises(ValueError, match="reward must be"):
        Reinforce(reward="max")  # type: ignore[arg-type]


def test_mean_reward_moves_the_baseline_by_the_per_word_mean() -> None:
    torch.manual_seed(14)
    model = captioner(attention="hard", semi_sampling_prob=0.0).train()
    b = batch(14)
    objective = build_objective(attention="hard", vocab_size=V, reward="mean").train()
    torch.manual_seed(15)
    parts = objective(model, b.images, b)
    torch.manual_seed(15)
    total = MaximumLikelihood()(model, b.images, b)  # the same sample: same word log-likelihoods
    per_word = -total["nll_per_word"]  # Σ log p / Σ words, not the mean of the per-caption means
    assert parts["reward"].item() != pytest.approx(per_word.item())
    assert parts["baseline"].item() == pytest.approx(0.1 * parts["reward"].item())


# -- baselines: DDP and validation ------------------------------------------------------------------
class FakeAllReduce:
    """torch.distributed.all_reduce as if a second rank had added `other[shape]`."""

    def __init__(self, other: dict[tuple[int, ...], Tensor]) -> None:
        self.other = other
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, tensor: Tensor, op: Any = None) -> None:
        self.calls.append(tuple(tensor.shape))
        tensor.add_(self.other[tuple(tensor.shape)])


@pytest.mark.parametrize("advantage", ["sequence", "token"])
def test_baselines_average_the_batch_statistics_of_every_rank(
        advantage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(16)
    model = captioner(attention="hard", semi_sampling_prob=0.0,  # every caption samples
                      hard_decode="sample").train()
    b = batch(16, B=3)
    alone = build_objective(attention="hard", advantage=advantage, vocab_size=V).train()
    torch.manual_seed(17)
    local = alone(model, b.images, b)

    other_tokens = torch.zeros(2, V)
    other_tokens[:, 3] = torch.tensor([-8.0, 2.0])  # word 3 (<unk>, not in this batch): 2 × −4
    fake = FakeAllReduce({(2,): torch.tensor([-30.0, 3.0]),  # 3 captions with reward −10
                          (2, V): other_tokens})
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", fake)
    ddp = build_objective(attention="hard", advantage=advantage, vocab_size=V).train()
    torch.manual_seed(17)
    parts = ddp(model, b.images, b)
    assert parts["reward"] == local["reward"]  # the logged reward is this rank's
    n = 3
    expected = 0.1 * (n * local["reward"].item() - 30.0) / (n + 3)  # b_0 = 0, m = 0.9
    if advantage == "sequence":
        assert ddp.baseline.value.item() == pytest.approx(expected, rel=1e-5)
    else:  # against its per-word baseline: the moving average of R stays as it was
        assert ddp.baseline.value.item() == 0.0
        assert fake.calls == [(2, V)]
        assert isinstance(ddp, TokenReinforce) and isinstance(alone, TokenReinforce)
        assert ddp.token_baseline.value[3].item() == pytest.approx(-4.0)
        assert bool(ddp.token_baseline.seen[3]) and not bool(alone.token_baseline.seen[3])
        rest = torch.arange(V) != 3  # the words of this rank's batch: its own means
        torch.testing.assert_close(ddp.token_baseline.value[rest],
                                   alone.token_baseline.value[rest])
    if advantage == "sequence":
        assert fake.calls == [(2,)]
    ddp.eval()  # no update, so no collective, in eval mode (which still samples)
    assert "reinforce" in ddp(model.eval(), b.images, b)
    assert len(fake.calls) == 1


@pytest.mark.parametrize("advantage", ["sequence", "token", "expected"])
def test_a_rank_whose_forward_failed_stands_in_for_its_collectives(
        advantage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DDP rank whose forward pass failed (NaN attention to sample from) still takes part
    in the collectives the others' forward passes make, in the same order and shapes, with
    nothing of its own in them: else its gradient all-reduce would meet their baseline's."""
    model = captioner(attention="hard", semi_sampling_prob=0.0, hard_decode="sample").train()
    b = batch(16, B=3)
    fake = FakeAllReduce({(2,): torch.tensor([-30.0, 3.0]), (2, V): torch.zeros(2, V)})
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", fake)
    healthy = build_objective(attention="hard", advantage=advantage, vocab_size=V).train()
    healthy(model, b.images, b)
    made, fake.calls = fake.calls, []
    failed = build_objective(attention="hard", advantage=advantage, vocab_size=V).train()
    failed.stand_in(model)
    assert fake.calls == made == {"sequence": [(2,)], "token": [(2, V)], "expected": []}[
        advantage]
    if advantage == "sequence":  # the others' mean reward only: 3 captions of −10
        assert failed.baseline.value.item() == pytest.approx(0.1 * -10.0)
    fake.calls = []
    failed.eval().stand_in(model)  # no update, so no collective, outside training
    soft = build_objective(attention="soft", advantage=advantage, vocab_size=V).train()
    soft.stand_in(captioner(attention="soft"))
    assert fake.calls == []


def _gloo_rank(rank: int, init_file: str, out: str) -> None:
    """One of two gloo ranks: a training step of the token estimator on its own batch."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}",
                                         rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)
        model = captioner(attention="hard", semi_sampling_prob=0.0).train()
        objective = build_objective(attention="hard", advantage="token", vocab_size=V).train()
        b = batch(20 + rank, B=3)
        objective(model, b.images, b)
        torch.save(objective.state_dict(), f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # two processes: ~15 s on a 2-core machine
def test_baselines_agree_across_two_gloo_ranks(tmp_path: Path) -> None:
    """Two processes with different batches end the step with the same baselines."""
    out = str(tmp_path / "state")
    torch.multiprocessing.spawn(_gloo_rank, args=(str(tmp_path / "init"), out), nprocs=2)
    first, second = (torch.load(f"{out}.{r}", weights_only=True) for r in (0, 1))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert bool(first["token_baseline.seen"].any())
    assert first["token_baseline.value"].abs().sum() > 0


class BaselineWatch(L.Callback):
    """Records the objective's state around every validation epoch."""

    def __init__(self) -> None:
        self.pairs: list[tuple[dict[str, Tensor], dict[str, Tensor]]] = []
        self.rules: list[str] = []

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.before = {k: v.clone() for k, v in pl_module.objective.state_dict().items()}

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        dec = pl_module.captioner.decoder
        self.rules.append(dec.step_rule if not dec.training else "training")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        after = {k: v.clone() for k, v in pl_module.objective.state_dict().items()}
        self.pairs.append((self.before, after))


def test_validation_leaves_the_token_baseline_alone(shapes_dm_kwargs: dict, cache_dir: Path,
                                                    tmp_path: Path) -> None:
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    net = CaptionerConfig(vocab_size=dm.vocab_size, backbone="resnet18", weights=None,
                          grid_size=2, image_size=64, embed_dim=16, hidden_dim=16, attn_dim=16,
                          attention="hard", hard_decode="sample")
    module = CaptioningModule(net=net, advantage="token", compute_metrics=False,
                              decode=DecodeConfig(strategy="greedy", max_len=4))
    watch = BaselineWatch()
    trainer = L.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=2,
                        num_sanity_val_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, default_root_dir=str(tmp_path),
                        callbacks=[watch])
    trainer.fit(module, datamodule=dm)
    assert len(watch.pairs) == 3 and set(watch.rules) == {"sample"}  # sanity check + 2 epochs
    for before, after in watch.pairs:
        assert before.keys() == after.keys() and "token_baseline.value" in before
        assert all(torch.equal(before[k], after[k]) for k in before)
    assert bool(module.objective.token_baseline.seen.any())  # training did move it


# -- the config plumbing, end to end ---------------------------------------------------------------
def test_cli_fits_gumbel_hard_attention(shapes_dm_kwargs: dict, cache_dir: Path,
                                        tmp_path: Path) -> None:
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(tmp_path / "logs"), "name": "run"}}
    cfg = cli_config(tmp_path / "fit.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt",
                     logger=logger, log_every_n_steps=1)
    assert main(["fit", "--config", str(cfg), "--model.net.attention", "hard",
                 "--model.net.hard_estimator", "gumbel", "--model.net.gumbel_tau_start", "2.0",
                 "--model.net.gumbel_tau_end", "0.5", "--model.net.gumbel_anneal", "linear",
                 "--model.net.score", "scaled_dot", "--model.net.n_layers_att", "2",
                 "--model.net.n_layers_init", "2", "--model.reward", "mean",
                 "--model.entropy_weight", "0.01"]) == 0
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    net = ckpt["captioning_model_config"]
    assert (net["hard_estimator"], net["score"], net["n_layers_att"], net["gumbel_anneal"]) == \
        ("gumbel", "scaled_dot", 2, "linear")
    assert ckpt["hyper_parameters"]["reward"] == "mean"
    assert not any("baseline" in k for k in ckpt["state_dict"])  # no REINFORCE state
    rows = list(csv.DictReader(next((tmp_path / "logs").rglob("metrics.csv")).open()))
    taus = [float(r["train/gumbel_tau"]) for r in rows if r.get("train/gumbel_tau")]
    schedule = GumbelSchedule(start=2.0, end=0.5, anneal="linear")
    assert taus == pytest.approx([schedule.tau(s, BATCHES) for s in range(BATCHES)])
    assert any(r.get("train/attn_entropy") for r in rows)
    loaded = load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert loaded.captioner.decoder.hard_estimator == "gumbel"


CONCAT_SCORE = '''
import torch
from torch import nn

from captioning.models.attention import Scorer


class ConcatScore(Scorer):
    """e = v^T relu(W [k; h]): a score of one's own, outside the package."""

    def __init__(self, *, feature_dim, hidden_dim, attn_dim, n_layers=1):
        super().__init__(key_dim=attn_dim, n_layers=n_layers)
        self.key = nn.Linear(feature_dim, attn_dim)
        self.mix = nn.Linear(attn_dim + hidden_dim, attn_dim)
        self.v = nn.Linear(attn_dim, 1, bias=False)

    def forward(self, keys, h, *, keys_grad=None, rows=None, query=None):
        keys = self.running_keys(keys, h.size(0), rows)
        hh = h.unsqueeze(1).expand(-1, keys.size(1), -1)
        return self.v(torch.relu(self.mix(torch.cat([keys, hh], -1)))).squeeze(-1)
'''


def test_a_score_of_ones_own_by_its_import_path(shapes_dm_kwargs: dict, cache_dir: Path,
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`net.score` takes the import path of a `Scorer` subclass outside the package, whose
    module the user imports (`captioning --import M`): it trains through the CLI, every
    parameter gets a gradient, the checkpoint records the path and loads it again. Settings
    never import code: a checkpoint naming a module not imported is refused, and the module's
    code does not run."""
    import sys

    (tmp_path / "my_scores.py").write_text(CONCAT_SCORE + "\nIMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_scores", raising=False)
    net = dict(vocab_size=12, backbone="resnet18", weights=None, grid_size=2, image_size=64,
               embed_dim=8, hidden_dim=8, attn_dim=8, score="my_scores.ConcatScore")
    with pytest.raises(ValueError, match=r"module my_scores is not imported \(settings never "
                                         r"import code\): run `captioning --import my_scores"):
        CaptionerConfig(**net)
    assert "my_scores" not in sys.modules

    cfg = cli_config(tmp_path / "fit.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    assert main(["--import", "my_scores", "fit", "--config", str(cfg),
                 "--model.net.score", "my_scores.ConcatScore"]) == 0
    captioner = Captioner(CaptionerConfig(**net))
    assert type(captioner.decoder.attention).__name__ == "ConcatScore"
    feats = torch.randn(2, 4, captioner.encoder.dim)
    out = captioner.decoder(feats, torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0]]), torch.tensor([4, 3]))
    out.logits.logsumexp(-1).sum().backward()
    attention = captioner.decoder.attention
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attention.parameters())
    loaded = load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert loaded.config.score == "my_scores.ConcatScore"
    assert type(loaded.captioner.decoder.attention).__name__ == "ConcatScore"

    monkeypatch.delitem(sys.modules, "my_scores")  # a new process: loading imports nothing
    with pytest.raises(CheckpointError, match="module my_scores is not imported"):
        load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert "my_scores" not in sys.modules
    capsys.readouterr()
    for args, why in (
            (["--import", "no_such_module"], "--import no_such_module: cannot import it"),
            (["--import", "my_scores", "--model.net.score", "my_scores.Missing"],
             "net.score 'my_scores.Missing': module my_scores has no Missing"),
            (["--model.net.score", "torch.nn.Linear"],
             "net.score 'torch.nn.Linear' is not a subclass of captioning.models.attention."
             "Scorer"),
            (["--model.net.score", "cosine"],
             "net.score must be one of ['additive', 'dot', 'general', 'scaled_dot'] or the "
             "import path of a Scorer subclass (package.module.Class), got 'cosine'")):
        imports = args[:2] if args[0] == "--import" else []
        rest = args[len(imports):] or ["--model.net.score", "my_scores.ConcatScore"]
        assert main([*imports, "fit", "--config", str(cfg), *rest]) == 2
        (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
        assert line.startswith(f"error: {why}"), line
    assert not (tmp_path / "ckpt.previous").exists()  # a refused fit sets nothing aside
