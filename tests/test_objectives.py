"""Training objectives: the registry, and the state each objective owns."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from captioning.losses import caption_word_log_likelihoods, entropy_bonus, reinforce_loss
from captioning.models import Captioner, CaptionerConfig
from captioning.objectives import (
    ESTIMATORS,
    ExpectedReinforce,
    MaximumLikelihood,
    Reinforce,
    TokenReinforce,
    build_objective,
    register,
)

V, L, D = 12, 4, 512


def _captioner(attention: str, hard_decode: str = "expected") -> Captioner:
    torch.manual_seed(0)
    return Captioner(CaptionerConfig(vocab_size=V, backbone="resnet18", grid_size=None,
                                     embed_dim=8, hidden_dim=8, attn_dim=8, dropout=0.0,
                                     attention=attention, semi_sampling_prob=0.0,
                                     hard_decode=hard_decode))


def _batch() -> SimpleNamespace:
    captions = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 2, 0], [1, 4, 2, 0, 0]])
    return SimpleNamespace(captions=captions, lengths=torch.tensor([5, 4, 3]))


def test_build_picks_the_class_by_attention_and_advantage() -> None:
    assert type(build_objective(attention="soft", advantage="token")) is MaximumLikelihood
    for name, cls in (("sequence", Reinforce), ("token", TokenReinforce),
                      ("expected", ExpectedReinforce)):
        objective = build_objective(attention="hard", advantage=name, vocab_size=V,
                                    reward_scale=0.5, doubly_stochastic=0.0)
        assert type(objective) is cls and objective.reward_scale == 0.5
    with pytest.raises(ValueError, match="advantage must be one of"):
        build_objective(attention="hard", advantage="nope")
    # A typo is an error even where the value is not used (soft attention, Gumbel).
    for kw in ({"attention": "soft"}, {"attention": "hard", "hard_estimator": "gumbel"}):
        with pytest.raises(ValueError, match="advantage must be one of"):
            build_objective(**kw, advantage="bogus", vocab_size=V)
        with pytest.raises(ValueError, match="reward"):
            build_objective(**kw, reward="bogus", vocab_size=V)


@pytest.fixture
def constant_estimator() -> Iterator[type[Reinforce]]:
    @register("constant")
    class Constant(Reinforce):
        def reward_and_baseline(self, captioner: Captioner, features: Tensor, batch: object,
                                word_ll: Tensor, mask: Tensor,
                                sampled: Tensor | None) -> tuple[Tensor, Tensor]:
            return word_ll.sum(dim=1), torch.tensor(-3.0)

    yield Constant
    del ESTIMATORS["constant"]


def test_a_new_estimator_is_one_class_and_a_config_value(
        constant_estimator: type[Reinforce]) -> None:
    from captioning.lit_module import CaptioningModule

    module = CaptioningModule(net=_captioner("hard").config, advantage="constant").train()
    objective = module.objective
    assert type(objective) is constant_estimator
    outputs: list[Any] = []
    module.captioner.decoder.register_forward_hook(lambda m, args, out: outputs.append(out))
    torch.manual_seed(1)
    batch = _batch()
    parts = module.losses(batch, torch.randn(3, L, D))
    [out] = outputs  # the one teacher-forced pass, its locations sampled
    assert out.attn_log_probs is not None and out.attn_entropy is not None
    assert out.sampled is not None and bool(out.sampled.all())  # semi_sampling_prob 0
    word_ll, mask = caption_word_log_likelihoods(out.logits, batch.captions, batch.lengths)
    reward = word_ll.sum(dim=1)
    # the class's baseline (-3), not the moving average the default estimator would use
    assert parts["advantage"].item() == pytest.approx((reward + 3.0).mean().item(), rel=1e-6)
    rl = reinforce_loss(reward, out.attn_log_probs, mask, torch.tensor(-3.0),
                        sampled=out.sampled)
    torch.testing.assert_close(parts["reinforce"], rl)
    moving = reinforce_loss(reward, out.attn_log_probs, mask, torch.tensor(0.0),
                            sampled=out.sampled)
    assert not torch.allclose(rl, moving)  # b_0 = 0 would have given another loss
    entropy = entropy_bonus(out.attn_entropy, mask)
    torch.testing.assert_close(parts["loss"], parts["nll"] + objective.doubly_stochastic *
                               parts["doubly_stochastic"] + objective.reward_scale * rl -
                               objective.entropy_weight * entropy)


@pytest.mark.parametrize("advantage", ["sequence", "token"])
def test_baselines_move_in_training_only(advantage: str) -> None:
    captioner = _captioner("hard", hard_decode="sample").eval()  # eval still samples
    objective = build_objective(attention="hard", advantage=advantage, vocab_size=V)
    features = torch.randn(3, L, D)
    before = {k: v.clone() for k, v in objective.state_dict().items()}
    objective.eval()
    parts = objective(captioner, features, _batch())
    assert "reinforce" in parts  # the REINFORCE terms ran on sampled locations
    assert all(torch.equal(v, before[k]) for k, v in objective.state_dict().items())
    objective.train()
    captioner.train()
    objective(captioner, features, _batch())
    moved = not torch.equal(objective.baseline.value, before["baseline.value"])
    assert moved == (advantage == "sequence")  # the token estimator has its own
    if advantage == "token":
        assert bool(objective.token_baseline.seen[[4, 5, 6, 7, 8, 9, 2]].all())


def test_maximum_likelihood_is_the_nll_plus_the_penalty() -> None:
    captioner = _captioner("soft")
    parts = MaximumLikelihood(doubly_stochastic=0.3)(captioner, torch.randn(3, L, D), _batch())
    torch.testing.assert_close(parts["loss"], parts["nll"] + 0.3 * parts["doubly_stochastic"])
    assert set(parts) == {"loss", "nll", "nll_per_word", "doubly_stochastic", "attn_entropy"}
    # α's mean entropy over the real steps, by hand: a statistic, with no gradient
    batch = _batch()
    out = captioner.decoder(torch.randn(3, L, D), batch.captions, batch.lengths)
    steps = (batch.lengths - 1).tolist()
    alphas = out.alphas.detach()
    by_hand = [float(-(a * a.log()).sum()) for b, n in enumerate(steps) for a in alphas[b, :n]]
    entropy = MaximumLikelihood().likelihood(out, batch)[0]["attn_entropy"]
    assert not entropy.requires_grad
    assert float(entropy) == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-5)
    assert 0 < float(entropy) < math.log(L)


def test_settings_an_objective_ignores_are_named(caplog: pytest.LogCaptureFixture) -> None:
    """REINFORCE's settings set away from their defaults warn where the objective does not use
    them (soft attention, Gumbel); at their defaults, or with REINFORCE, nothing is said."""
    with caplog.at_level("WARNING", logger="captioning.objectives"):
        build_objective(attention="hard", hard_estimator="gumbel", advantage="expected",
                        reward_scale=1.0, entropy_weight=0.01, vocab_size=V)
        assert caplog.messages == ["no effect on GumbelStraightThrough (hard attention): "
                                   "model.reward_scale 1.0, model.advantage 'expected'"]
        caplog.clear()
        build_objective(attention="soft", advantage="sequence", reward_scale=0.1, vocab_size=V)
        build_objective(attention="hard", advantage="expected", reward_scale=1.0, vocab_size=V)
        assert caplog.messages == []
