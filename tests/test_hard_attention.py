"""Stochastic hard attention (Xu et al. 2015, §4.1): REINFORCE, baseline, semi-sampling, decoding."""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from captioning.lit_module import CaptioningModule
from captioning.losses import (
    MovingAverageBaseline,
    TokenBaseline,
    caption_word_log_likelihoods,
    entropy_bonus,
    reinforce_loss,
    reward_to_go,
    target_mask,
)
from captioning.models import AttentionLSTMDecoder, CaptionerConfig
from captioning.models.attention import LOG_EPS, AdditiveAttention, select
from captioning.models.decoding import beam_search, greedy_search
from captioning.models.state import Memory
from captioning.objectives import expected_word_log_likelihoods

V, D, L = 12, 16, 5
PAD, START, END = 0, 1, 2


def make_decoder(**kw) -> AttentionLSTMDecoder:
    args = dict(vocab_size=V, feature_dim=D, embed_dim=16, hidden_dim=32, attn_dim=16,
                dropout=0.0, attention="hard")
    args.update(kw)
    return AttentionLSTMDecoder(**args)


def random_batch(B: int, *, seed: int, max_words: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, max_words + 1, (B,), generator=g)
    n[0] = max_words
    lengths = n + 2
    caps = torch.full((B, max_words + 2), PAD, dtype=torch.long)
    for i, k in enumerate(n.tolist()):
        caps[i, : k + 2] = torch.tensor([START, *torch.randint(4, V, (k,), generator=g).tolist(), END])
    return torch.randn(B, L, D, generator=g), caps, lengths


def log_likelihood(out, caps: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    word_ll, mask = caption_word_log_likelihoods(out.logits, caps, lengths)
    return word_ll.sum(1), mask


# -- REINFORCE is unbiased ----------------------------------------------------------------------
# Toy problem: L = 3 locations, T = 2 steps, so 9 location sequences s = (s1, s2).
#   p(s1)      = softmax(θ1)            (attention logits that are parameters)
#   p(s2 | s1) = softmax(θ2 + W[s1])    (step-2 logits depend on the step-1 sample, as through h_t)
#   log p(y | s, a) = R[s1, s2]         (a known table standing in for the caption likelihood)
# The ascent direction of E_s[log p(y|s,a)] is ∇J with J = Σ_s p(s)(R(s) − b); the Monte Carlo
# gradient of reinforce_loss is −(R − b)∇log p(s), so its mean must approach −∇J.
TOY_L = 3
R_TABLE = torch.tensor([[-0.5, -2.0, -1.0], [-3.0, -0.2, -1.5], [-1.0, -1.2, -4.0]])
# Reward-to-go (the "token" and "expected" advantages): word rewards r_1 = R1[s1] and
# r_2 = R_TABLE − R1 (so the caption reward is unchanged, and word 2 depends on both locations,
# word 1 on s1 only: causal, as in the decoder).
# α_1 gets (r_1 + r_2) − (b_1 + b_2) and α_2 gets r_2 − b_2: still an unbiased estimate of −∇J,
# for any per-step baselines that do not depend on the sampled locations.
R1 = torch.tensor([-0.3, -1.1, -0.6])


def toy_params() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(123)
    return (torch.randn(TOY_L, generator=g), torch.randn(TOY_L, generator=g),
            torch.randn(TOY_L, TOY_L, generator=g))


def exact_gradient(baseline: float) -> Tensor:
    """∇J by enumerating all 9 sequences; flattened (θ1, θ2, W)."""
    t1, t2, w = (p.clone().requires_grad_() for p in toy_params())
    J = torch.zeros(())
    for s1, s2 in itertools.product(range(TOY_L), repeat=2):
        p = F.softmax(t1, -1)[s1] * F.softmax(t2 + w[s1], -1)[s2]
        J = J + p * (R_TABLE[s1, s2] - baseline)
    grads = torch.autograd.grad(J, (t1, t2, w))
    return torch.cat([g.flatten() for g in grads])


def per_sample_gradients(baseline: float, n: int, seed: int, *,
                         word_baselines: tuple[float, float] | None = None) -> Tensor:
    """(n, 15) gradients of reinforce_loss per sample; their mean is the MC gradient.

    Each sample gets its own copy of the parameters, so the gradient of the batch-mean surrogate
    w.r.t. copy i is g_i / n. The locations are drawn by the project's select(rule="sample").
    With `word_baselines`, the reward is the reward-to-go of the word rewards (see R1 below)
    against the reward-to-go of those per-step baselines, instead of R − `baseline`.
    """
    t1, t2, w = toy_params()
    t1 = t1.expand(n, TOY_L).clone().requires_grad_()
    t2 = t2.expand(n, TOY_L).clone().requires_grad_()
    w = w.expand(n, TOY_L, TOY_L).clone().requires_grad_()
    torch.manual_seed(seed)
    sel1 = select(t1, "sample")
    sel2 = select(t2 + w[torch.arange(n), sel1.location], "sample")
    loglik = R_TABLE[sel1.location, sel2.location]  # log p(y | s̃, a), (n,)
    log_probs = torch.stack([sel1.log_prob, sel2.log_prob], dim=1)  # (n, T)
    mask = torch.ones(n, 2, dtype=torch.bool)
    if word_baselines is None:
        loss = reinforce_loss(loglik, log_probs, mask, torch.tensor(baseline))
    else:
        r1 = R1[sel1.location]
        words = torch.stack([r1, loglik - r1], dim=1)  # (n, 2) word rewards, summing to R
        base = reward_to_go(torch.tensor(word_baselines).expand(n, 2), mask)
        loss = reinforce_loss(reward_to_go(words, mask), log_probs, mask, base)
    grads = torch.autograd.grad(loss, (t1, t2, w))
    return torch.cat([g.reshape(n, -1) for g in grads], dim=1) * n


def mc_gradient_shared(baseline: float, n: int, seed: int) -> Tensor:
    """The same estimator with shared parameters (as in training): one backward, no copies."""
    t1, t2, w = (p.clone().requires_grad_() for p in toy_params())
    torch.manual_seed(seed)
    sel1 = select(t1.expand(n, TOY_L), "sample")
    sel2 = select(t2 + w[sel1.location], "sample")
    loglik = R_TABLE[sel1.location, sel2.location]
    log_probs = torch.stack([sel1.log_prob, sel2.log_prob], dim=1)
    loss = reinforce_loss(loglik, log_probs, torch.ones(n, 2, dtype=torch.bool), baseline)
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, (t1, t2, w))])


N_MC = 20_000
# Tolerance: each component of the mean of N i.i.d. per-sample gradients is within 5 standard
# errors (empirical std / √N) of its expectation. With N = 20 000 the mean is Gaussian to a very
# good approximation (CLT; the per-sample gradients are bounded), so a 5σ two-sided miss has
# probability ≈ 6e-7 per component, < 1e-5 for all 15 by the union bound; the RNG is seeded, so
# the test is deterministic anyway. Bias of a wrong estimator (e.g. a flipped sign) is shown below
# to be many standard errors, so the tolerance is tight enough to catch it.
N_SE = 5.0


@pytest.mark.parametrize("baseline", [0.0, -1.3])
def test_reinforce_gradient_is_unbiased(baseline: float) -> None:
    exact_ascent = exact_gradient(baseline)  # ∇J
    g = per_sample_gradients(baseline, N_MC, seed=0)
    mean = g.mean(0)
    se = g.std(0) / N_MC**0.5
    assert torch.all(se > 0)
    # reinforce_loss is minimised: its gradient estimates −∇J (the descent direction).
    assert torch.all((mean - (-exact_ascent)).abs() <= N_SE * se), (mean, -exact_ascent, se)
    # The test has power: the wrong sign is far outside the tolerance.
    assert ((mean - exact_ascent).abs() / se).max() > 4 * N_SE
    # Per-sample copies give the same total as the shared-parameter estimator used in training.
    torch.testing.assert_close(mc_gradient_shared(baseline, N_MC, seed=0), mean, atol=1e-5,
                               rtol=1e-4)


def test_reinforce_gradient_ignores_the_baseline_in_expectation() -> None:
    # Σ_s p(s) = 1, so the exact gradient does not depend on b ...
    torch.testing.assert_close(exact_gradient(0.0), exact_gradient(-1.3))
    # ... and on the same samples the two estimators differ by (b1 − b2)∇log p(s̃), whose mean
    # is E[∇log p(s)] = 0: the difference is within 5 standard errors of zero.
    g0 = per_sample_gradients(0.0, N_MC, seed=1)
    g1 = per_sample_gradients(-1.3, N_MC, seed=1)
    diff = g0 - g1
    assert bool(diff.abs().max() > 0)
    assert torch.all(diff.mean(0).abs() <= N_SE * diff.std(0) / N_MC**0.5)
    # A baseline near E[log p(y|s)] (≈ −1.3 here) reduces the variance: the point of §4.1's b.
    assert g1.var(0).sum() < 0.5 * g0.var(0).sum()


def test_reward_to_go_with_word_baselines_is_unbiased() -> None:
    exact = exact_gradient(0.0)
    g = per_sample_gradients(0.0, N_MC, seed=5, word_baselines=(-0.6, -0.7))
    mean, se = g.mean(0), g.std(0) / N_MC**0.5
    assert torch.all((mean - (-exact)).abs() <= N_SE * se), (mean, -exact, se)
    # Against the paper's estimator with its best constant baseline on the same samples, the
    # per-step credit has lower total variance here (s2 cannot change word 1's reward).
    paper = per_sample_gradients(-1.3, N_MC, seed=5)
    assert g.var(0).sum() < paper.var(0).sum()


def test_reward_to_go() -> None:
    r = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert reward_to_go(r, mask).tolist() == [[6.0, 5.0, 3.0], [9.0, 5.0, 0.0]]


def test_token_baseline_update_rule() -> None:
    b = TokenBaseline(vocab_size=6, momentum=0.9)
    targets = torch.tensor([[3, 4, 3], [3, 5, 1]])
    rewards = torch.tensor([[-1.0, -2.0, -3.0], [-5.0, -7.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    b.update(rewards, targets, mask)
    # First sight takes the batch mean: word 3 mean(−1, −3, −5) = −3, word 4 −2; words 5 and 1
    # occur only under padding: unchanged and still unseen.
    assert b.value.tolist() == pytest.approx([0.0, 0.0, 0.0, -3.0, -2.0, 0.0])
    assert b.seen.tolist() == [False, False, False, True, True, False]
    b.update(torch.full((2, 3), -1.0), targets, torch.ones(2, 3, dtype=torch.bool))
    # Then the moving average: word 3 0.9·(−3) + 0.1·(−1); word 5 and 1 seen for the first time.
    assert b.value.tolist() == pytest.approx([0.0, -1.0, 0.0, -2.8, -1.9, -1.0])
    assert b(targets).shape == (2, 3) and b(targets)[0, 1].item() == pytest.approx(b.value[4])
    assert list(b.parameters()) == [] and set(b.state_dict()) == {"value", "seen"}


def test_token_advantage_is_saved_with_the_module() -> None:
    net = CaptionerConfig(vocab_size=V, backbone="resnet18", hidden_dim=16, embed_dim=16,
                          attn_dim=16, attention="hard")
    assert "objective.token_baseline.value" in CaptioningModule(net=net, advantage="token").state_dict()
    assert "objective.token_baseline.value" not in CaptioningModule(net=net).state_dict()
    with pytest.raises(ValueError, match="advantage"):
        CaptioningModule(net=net, advantage="word")


# -- baseline -----------------------------------------------------------------------------------
def test_moving_average_baseline_update_rule() -> None:
    b = MovingAverageBaseline()
    assert b.momentum == 0.9
    assert b.value.item() == 0.0  # b_0 = 0
    expected = 0.0
    for r in ([-2.0, -4.0], [-10.0], [1.0, 2.0, 3.0]):
        expected = 0.9 * expected + 0.1 * (sum(r) / len(r))  # batch mean reward
        out = b.update(torch.tensor(r, requires_grad=True))
        assert not out.requires_grad
        assert b.value.item() == pytest.approx(expected, rel=1e-6)
    assert b.value.item() == pytest.approx(0.9 * (0.9 * -0.3 + 0.1 * -10.0) + 0.1 * 2.0)


def test_baseline_is_a_buffer() -> None:
    b = MovingAverageBaseline()
    b.update(torch.tensor([-5.0]))
    assert list(b.parameters()) == []
    assert "value" in dict(b.named_buffers())
    state = b.state_dict()
    assert set(state) == {"value"} and state["value"].item() == pytest.approx(-0.5)
    restored = MovingAverageBaseline()
    restored.load_state_dict(state)
    assert restored.value.item() == pytest.approx(-0.5)
    moved = b.to(torch.float64)
    assert moved.value.dtype == torch.float64  # follows the module across dtype/device moves
    if torch.cuda.is_available():
        assert b.to("cuda").value.is_cuda
    # The hard-attention objective holds it, so it is saved with checkpoints; a soft model's
    # maximum-likelihood objective has no baseline.
    net = CaptionerConfig(vocab_size=V, backbone="resnet18", hidden_dim=16, embed_dim=16,
                          attn_dim=16)
    assert "objective.baseline.value" in CaptioningModule(
        net=replace(net, attention="hard")).state_dict()
    assert not any("baseline" in k for k in CaptioningModule(net=net).state_dict())


# -- one SGD step on the surrogate --------------------------------------------------------------
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_advantage_sign_moves_the_sampled_location(advantage: float) -> None:
    torch.manual_seed(2)
    att = AdditiveAttention(feature_dim=D, hidden_dim=8, attn_dim=8)
    feats, h = torch.randn(4, L, D), torch.randn(4, 8)

    def log_alpha() -> Tensor:
        return F.log_softmax(att(att.project(feats), h), dim=-1)  # (B, L)

    sel = select(att(att.project(feats), h), "sample")
    before = log_alpha().gather(1, sel.location.unsqueeze(1)).squeeze(1).detach()
    loglik = torch.full((4,), advantage)  # log p(y | s̃, a) with baseline 0: advantage = ±1
    loss = reinforce_loss(loglik, sel.log_prob.unsqueeze(1), torch.ones(4, 1, dtype=torch.bool),
                          0.0)
    opt = torch.optim.SGD(att.parameters(), lr=0.05)
    opt.zero_grad()
    loss.backward()
    opt.step()
    after = log_alpha().gather(1, sel.location.unsqueeze(1)).squeeze(1).detach()
    change = (after - before).sum().item()  # joint log p(s̃) of the batch
    assert change > 0 if advantage > 0 else change < 0


# -- which terms train the scorer ---------------------------------------------------------------
def attention_grads(dec: AttentionLSTMDecoder) -> list[Tensor | None]:
    return [p.grad for p in dec.attention.parameters()]


@pytest.mark.parametrize("grad", ["paper", "detached"])
@pytest.mark.parametrize("prob", [0.0, 0.5, 1.0])
def test_which_terms_train_the_hard_scorer(prob: float, grad: str) -> None:
    """The likelihood trains the scorer through the captions that used the expected context
    (semi-sampling) with the paper's gradient (the default), never through sampled ones; with
    `semi_sampling_grad: detached` only the entropy and REINFORCE terms reach it."""
    torch.manual_seed(3)
    dec = make_decoder(semi_sampling_prob=prob, semi_sampling_grad=grad).train()
    assert make_decoder().semi_sampling_grad == "paper"  # the default
    feats, caps, lengths = random_batch(8, seed=3)
    out = dec(feats, caps, lengths)
    if prob == 0.5:  # both kinds of caption are in the batch
        assert bool(out.sampled.any()) and bool((~out.sampled).any())
    else:  # every caption sampled (0.0) or used the expected context (1.0)
        assert bool(out.sampled.all()) if prob == 0.0 else not bool(out.sampled.any())
    loglik, mask = log_likelihood(out, caps, lengths)
    (-loglik.mean()).backward(retain_graph=True)
    if grad == "paper" and prob > 0.0:
        assert all(g is not None and bool(g.any()) for g in attention_grads(dec))
    else:
        assert all(g is None or not bool(g.any()) for g in attention_grads(dec))
    assert dec.lstm.weight_ih.grad is not None and bool(dec.lstm.weight_ih.grad.any())

    # The entropy term alone does reach it ...
    dec.zero_grad(set_to_none=True)
    (-entropy_bonus(out.attn_entropy, mask)).backward(retain_graph=True)
    assert all(g is not None and bool(g.any()) for g in attention_grads(dec))
    # ... and so does REINFORCE, when some caption sampled its locations.
    dec.zero_grad(set_to_none=True)
    rl = reinforce_loss(loglik, out.attn_log_probs, mask, -10.0, sampled=out.sampled)
    if prob < 1.0:
        rl.backward()
        assert all(g is not None and bool(g.any()) for g in attention_grads(dec))
    else:
        assert rl.item() == 0.0  # semi-sampled captions contribute nothing


# -- semi-sampling coin -------------------------------------------------------------------------
def coin_draws(mode: str, prob: float, draws: int = 40, batch: int = 32) -> Tensor:
    """(draws, batch) bool: out.sampled of many one-word teacher-forced passes."""
    torch.manual_seed(4)
    dec = make_decoder(semi_sampling=mode, semi_sampling_prob=prob).train()
    feats = torch.randn(batch, L, D)
    caps = torch.tensor([[START, 4, END]]).expand(batch, 3)
    lengths = torch.full((batch,), 3)
    with torch.no_grad():
        return torch.stack([dec(feats, caps, lengths).sampled for _ in range(draws)])


def test_semi_sampling_per_batch_shares_one_coin() -> None:
    s = coin_draws("batch", 0.5)
    assert torch.all(s == s[:, :1])  # every caption of a batch makes the same choice
    assert bool(s[:, 0].any()) and bool((~s[:, 0]).any())  # both choices occur over batches


def test_semi_sampling_per_image_frequency() -> None:
    p = 0.3  # probability of the expected context (sampled False)
    s = coin_draws("image", p, draws=50, batch=64)
    mixed = (s.any(1) & (~s).any(1)).float().mean()
    assert mixed > 0.9  # mixed choices within a batch
    freq = (~s).float().mean().item()
    n = s.numel()
    assert abs(freq - p) < 5 * (p * (1 - p) / n) ** 0.5  # 5σ of a Binomial(3200, 0.3) frequency


@pytest.mark.parametrize("mode", ["image", "batch"])
def test_semi_sampling_edge_probabilities(mode: str) -> None:
    assert bool(coin_draws(mode, 0.0, draws=10).all())  # never the expected context
    assert not bool(coin_draws(mode, 1.0, draws=10).any())  # always the expected context


def test_semi_sampled_captions_use_exactly_the_expected_context() -> None:
    torch.manual_seed(5)
    dec = make_decoder(semi_sampling_prob=1.0, hard_decode="expected")
    feats, caps, lengths = random_batch(4, seed=5)
    train_out = dec.train()(feats, caps, lengths)
    eval_out = dec.eval()(feats, caps, lengths)
    torch.testing.assert_close(train_out.logits, eval_out.logits)
    torch.testing.assert_close(train_out.alphas, eval_out.alphas)
    # prob 0: every caption samples, so the logits differ from the expected-context ones.
    dec.semi_sampling_prob = 0.0
    sampled_out = dec.train()(feats, caps, lengths)
    assert not torch.allclose(sampled_out.logits, eval_out.logits)


def test_bad_hard_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="semi_sampling_prob"):
        make_decoder(semi_sampling_prob=1.5)
    with pytest.raises(ValueError, match="semi_sampling"):
        make_decoder(semi_sampling="caption")
    with pytest.raises(ValueError, match="hard_decode"):
        make_decoder(hard_decode="mode")
    with pytest.raises(ValueError, match="unknown attention weight rule"):
        select(torch.zeros(1, 3), "mean")  # type: ignore[arg-type]


# -- decoding a hard model ----------------------------------------------------------------------
def test_hard_expected_decoding_is_deterministic_and_matches_soft() -> None:
    torch.manual_seed(6)
    hard = make_decoder(hard_decode="expected").eval()
    soft = make_decoder(attention="soft").eval()
    soft.load_state_dict(hard.state_dict())
    feats = torch.randn(3, L, D)
    for search in (greedy_search, beam_search):
        a, b, c = search(hard, feats, max_len=6), search(hard, feats, max_len=6), search(
            soft, feats, max_len=6)
        for x, y in ((a, b), (a, c)):
            assert torch.equal(x.tokens, y.tokens)
            torch.testing.assert_close(x.scores, y.scores)
            torch.testing.assert_close(x.alphas, y.alphas)


def test_hard_argmax_decoding_uses_a_one_hot_context() -> None:
    torch.manual_seed(7)
    dec = make_decoder(hard_decode="argmax").eval()
    feats = torch.randn(4, L, D)
    memory = dec.memory(feats)
    state = dec.init_state(memory)
    tokens = torch.full((4,), START)
    with torch.no_grad():
        for _ in range(3):
            log_probs, new_state, alpha = dec.step(tokens, state, memory)
            loc = alpha.argmax(-1)
            assert torch.equal(new_state.location, loc)
            # Changing the annotation vectors a_i away from argmax α changes nothing: z_t = a_loc.
            # (Keys stay, so α is the same; only the context could see the change.)
            keep = F.one_hot(loc, L).bool().unsqueeze(-1)
            other = Memory(torch.where(keep, memory.values, torch.randn_like(memory.values)),
                           memory.keys)
            lp2, st2, alpha2 = dec.step(tokens, state, other)
            torch.testing.assert_close(lp2, log_probs, rtol=0, atol=0)
            assert torch.equal(st2.location, loc)
            torch.testing.assert_close(alpha2, alpha, rtol=0, atol=0)
            # The expected rule does see it: this check is not vacuous.
            dec.hard_decode = "expected"
            lp3, _, _ = dec.step(tokens, state, other)
            assert not torch.allclose(lp3, log_probs)
            dec.hard_decode = "argmax"
            state, tokens = new_state, log_probs.argmax(-1)
    gen = greedy_search(dec, feats, max_len=5)
    mask = torch.arange(gen.tokens.size(1)) < gen.lengths.unsqueeze(1)
    assert torch.equal(gen.locations[mask], gen.alphas.argmax(-1)[mask])


def test_hard_sample_decoding_varies_with_the_seed() -> None:
    torch.manual_seed(8)
    dec = make_decoder(hard_decode="sample").eval()
    feats = torch.randn(4, L, D)

    def run(seed: int):
        torch.manual_seed(seed)
        return greedy_search(dec, feats, max_len=6)

    a, b = run(0), run(0)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.locations, b.locations)
    runs = [run(s) for s in range(1, 6)]
    assert len({tuple(r.locations.flatten().tolist()) for r in [a, *runs]}) > 1
    # The reported locations are samples, not the argmax.
    assert any(not torch.equal(r.locations, r.alphas.argmax(-1)) for r in runs)


# -- numerical safety ---------------------------------------------------------------------------
def test_peaked_attention_gives_finite_log_probs_and_entropy() -> None:
    scores = torch.tensor([[1e4, 0.0, 0.0], [0.0, -1e4, 0.0], [-50.0, 0.0, -1e30]],
                          requires_grad=True)
    torch.manual_seed(9)
    sel = select(scores, "sample")
    assert sel.alpha[0, 1] == 0 and sel.alpha[2, 2] == 0  # probabilities that underflowed
    assert torch.isfinite(sel.log_prob).all() and torch.isfinite(sel.entropy).all()
    assert (sel.entropy >= 0).all()
    (sel.log_prob.sum() + sel.entropy.sum()).backward()
    assert torch.isfinite(scores.grad).all()


@pytest.mark.parametrize("rule", ["gumbel", "sample"])
def test_a_chosen_location_of_vanishing_probability_has_the_floored_log_prob(
        rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """log p(s_t) = log max(α, LOG_EPS): exactly log LOG_EPS where α underflowed to 0, the
    plain log α elsewhere."""
    scores = torch.tensor([[1e4, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    chosen = torch.tensor([1, 2])  # row 0: α = exp(-1e4) = 0 in float32; row 1: α = 1/3
    noise = None
    if rule == "gumbel":  # noise large enough to make the chosen location the argmax
        noise = torch.zeros(2, 3)
        noise[0, 1] = noise[1, 2] = 1e5
    else:
        def multinomial(probs: Tensor, n: int) -> Tensor:
            assert n == 1 and probs[0, 1] == 0  # a draw it would (almost) never make
            return chosen.unsqueeze(1)

        monkeypatch.setattr(torch, "multinomial", multinomial)
    sel = select(scores, rule, noise=noise)  # type: ignore[arg-type]
    assert torch.equal(sel.location, chosen) and sel.alpha[0, 1] == 0
    assert sel.log_prob is not None
    floor = torch.log(torch.tensor(LOG_EPS, dtype=torch.float32))
    assert sel.log_prob[0] == floor  # not -inf: the floor
    torch.testing.assert_close(sel.log_prob[1], torch.log(torch.tensor(1 / 3)))  # no floor
    sel.log_prob.sum().backward()
    assert torch.isfinite(scores.grad).all()


@pytest.mark.parametrize("advantage", ["sequence", "token", "expected"])
def test_hard_training_with_extreme_inputs_stays_finite(advantage: str) -> None:
    torch.manual_seed(10)
    module = CaptioningModule(net=CaptionerConfig(
        vocab_size=V, backbone="resnet18", grid_size=None, embed_dim=16, hidden_dim=16,
        attn_dim=16, dropout=0.0, attention="hard", semi_sampling_prob=0.5),
        advantage=advantage).train()
    opt = torch.optim.Adam(module.captioner.decoder.parameters(), lr=1e-2)
    for step in range(30):
        feats, caps, lengths = random_batch(8, seed=100 + step)
        feats = torch.randn(8, L, 512) * 1e3  # huge annotation vectors
        parts = module.losses(SimpleNamespace(images=feats, captions=caps, lengths=lengths), feats)
        assert all(torch.isfinite(v).all() for v in parts.values()), parts
        opt.zero_grad()
        parts["loss"].backward()
        assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)
        opt.step()
    assert all(torch.isfinite(p).all() for p in module.parameters())
    baseline = module.objective.baseline.value
    assert torch.isfinite(baseline) and (baseline.item() != 0.0) == (advantage == "sequence")
    if advantage == "token":  # the per-word baseline moved for the target words (END, 4..V-1)
        b = module.objective.token_baseline.value
        assert torch.isfinite(b).all() and bool((b[[END, *range(4, V)]] < 0).all())
        assert bool((b[[PAD, START, 3]] == 0).all())  # never a target


def test_expected_context_baseline_scores_the_sampled_captions_without_gradient() -> None:
    torch.manual_seed(11)
    module = CaptioningModule(net=CaptionerConfig(
        vocab_size=V, backbone="resnet18", grid_size=None, embed_dim=16, hidden_dim=16,
        attn_dim=16, dropout=0.0, attention="hard"), advantage="expected").train()
    feats, caps, lengths = random_batch(6, seed=11)
    feats = torch.randn(6, L, 512)
    batch = SimpleNamespace(images=feats, captions=caps, lengths=lengths)
    rows = torch.tensor([True, False, True, True, False, False])
    T = int(lengths.max()) - 1
    ll = expected_word_log_likelihoods(module.captioner, feats, batch, rows, T)
    assert ll.shape == (6, T) and not ll.requires_grad
    assert bool((ll[~rows] == 0).all())
    dec = module.captioner.decoder
    ref = dec(feats, caps, lengths, rule="expected")  # deterministic: dropout 0, no sampling
    mask = target_mask(lengths, T)
    expected = (F.log_softmax(ref.logits, -1).gather(-1, caps[:, 1:T + 1, None])[..., 0]) * mask
    torch.testing.assert_close(ll[rows], expected[rows])
    assert bool((ll[rows][mask[rows]] < 0).all())
    # The training loss runs with it and the scorer learns.
    parts = module.losses(batch, feats)
    parts["loss"].backward()
    assert all(p.grad is not None and bool(p.grad.any()) for p in dec.attention.parameters())


@pytest.mark.parametrize("advantage", ["sequence", "token", "expected"])
def test_only_the_sequence_estimator_moves_and_logs_the_moving_baseline(advantage: str) -> None:
    """The token and expected estimators take their advantage against their own baselines:
    the moving average of R is neither updated (no collective) nor logged as if it were."""
    torch.manual_seed(0)
    module = CaptioningModule(net=CaptionerConfig(
        vocab_size=V, backbone="resnet18", grid_size=None, embed_dim=16, hidden_dim=16,
        attn_dim=16, attention="hard", semi_sampling_prob=0.0), advantage=advantage).train()
    _, caps, lengths = random_batch(6, seed=5)
    feats = torch.randn(6, L, 512)  # resnet18's 512-wide grid
    parts = module.losses(SimpleNamespace(images=feats, captions=caps, lengths=lengths), feats)
    moved = bool(module.objective.baseline.value != 0)
    assert moved == ("baseline" in parts) == (advantage == "sequence")
