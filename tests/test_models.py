"""Model behaviour: shapes, masking, sorting, gradients, overfitting, encoder backbones."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import Tensor

from captioning.lit_module import CaptioningModule
from captioning.losses import caption_word_log_likelihoods, target_mask, word_log_likelihoods
from captioning.models import AttentionLSTMDecoder, Captioner, CaptionerConfig, CNNEncoder
from captioning.models.decoder import DecoderOutput
from captioning.models.decoding import greedy_search
from captioning.models.encoder import BACKBONES

V, D, L = 12, 16, 6  # vocabulary (4 specials + 8 words), feature dim, locations
PAD, START, END = 0, 1, 2


def make_decoder(**kw) -> AttentionLSTMDecoder:
    args = dict(vocab_size=V, feature_dim=D, embed_dim=16, hidden_dim=32, attn_dim=16, dropout=0.0)
    args.update(kw)
    return AttentionLSTMDecoder(**args)


def make_captions(words: list[list[int]]) -> tuple[Tensor, Tensor]:
    """<start> w.. <end> <pad>.. rows (B, T+1) and lengths incl. specials."""
    lengths = torch.tensor([len(w) + 2 for w in words])
    caps = torch.full((len(words), int(lengths.max())), PAD, dtype=torch.long)
    for i, w in enumerate(words):
        caps[i, : len(w) + 2] = torch.tensor([START, *w, END])
    return caps, lengths


def random_batch(B: int, *, seed: int = 0, max_words: int = 5) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, max_words + 1, (B,), generator=g).tolist()
    n[0] = max_words  # at least one caption of the longest length
    words = [torch.randint(4, V, (k,), generator=g).tolist() for k in n]
    caps, lengths = make_captions(words)
    feats = torch.randn(B, L, D, generator=g)
    return feats, caps, lengths


def loss_of(out: DecoderOutput, caps: Tensor, lengths: Tensor) -> Tensor:
    """The mean over captions of −log p(y | a)."""
    return -caption_word_log_likelihoods(out.logits, caps, lengths)[0].sum(1).mean()


# -- shapes and masking -------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_forward_shapes(attention: str) -> None:
    torch.manual_seed(0)
    dec = make_decoder(attention=attention)
    feats, caps, lengths = random_batch(4)
    out = dec(feats, caps, lengths)
    T = int(lengths.max()) - 1
    assert out.logits.shape == (4, T, V)
    assert out.alphas.shape == (4, T, L)
    if attention == "hard":  # training mode: sampled locations, their log-probs and entropies
        assert out.attn_log_probs is not None and out.attn_log_probs.shape == (4, T)
        assert out.attn_entropy is not None and out.attn_entropy.shape == (4, T)
        assert out.sampled is not None and out.sampled.shape == (4,)
        assert out.sampled.dtype == torch.bool
    else:
        assert out.attn_log_probs is None and out.attn_entropy is None and out.sampled is None


def test_captioner_forward_from_images_and_from_features() -> None:
    torch.manual_seed(0)
    cfg = CaptionerConfig(vocab_size=V, backbone="resnet18", weights=None, grid_size=None,
                          image_size=64, embed_dim=16, hidden_dim=32, attn_dim=16, dropout=0.0)
    model = Captioner(cfg).eval()
    assert model.grid == (2, 2)  # 64 px at stride 32
    images = torch.randn(2, 3, 64, 64)
    caps, lengths = make_captions([[4, 5, 6], [7]])
    feats = model.encode(images)
    assert feats.shape == (2, 4, 512)
    assert model.encode(feats) is feats  # cached (B, L, D) features pass through
    out = model(images, caps, lengths)
    assert out.logits.shape == (2, 4, V) and out.alphas.shape == (2, 4, 4)
    torch.testing.assert_close(out.logits, model(feats, caps, lengths).logits)


def test_a_model_cast_whole_takes_float32_images() -> None:
    """A bf16 model (bf16-true) encodes float32 images as their bfloat16 values: a loader not
    behind the data module's cast (`on_after_batch_transfer`) still trains it."""
    torch.manual_seed(0)
    cfg = CaptionerConfig(vocab_size=V, backbone="resnet18", weights=None, grid_size=None,
                          image_size=64, embed_dim=16, hidden_dim=32, attn_dim=16, dropout=0.0)
    model = Captioner(cfg).eval().to(torch.bfloat16)
    images = torch.randn(2, 3, 64, 64)
    feats = model.encode(images)
    assert feats.dtype == torch.bfloat16
    assert torch.equal(feats, model.encode(images.to(torch.bfloat16)))


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_alpha_rows_sum_to_one_and_vanish_past_the_end(attention: str) -> None:
    torch.manual_seed(1)
    dec = make_decoder(attention=attention)
    feats, caps, lengths = random_batch(6, seed=1)
    out = dec(feats, caps, lengths)
    mask = target_mask(lengths, out.alphas.size(1))
    sums = out.alphas.sum(-1)
    torch.testing.assert_close(sums[mask], torch.ones(int(mask.sum())))
    assert torch.all(out.alphas[~mask] == 0)
    assert bool((~mask).any())  # the batch really has padding
    if attention == "hard":
        assert torch.all(out.attn_log_probs[~mask] == 0) and torch.all(out.attn_entropy[~mask] == 0)
        assert torch.all(out.attn_log_probs[mask] <= 0)


def test_padding_gets_no_loss() -> None:
    torch.manual_seed(2)
    dec = make_decoder().eval()
    feats, caps, lengths = random_batch(5, seed=2)
    out = dec(feats, caps, lengths)
    loss = loss_of(out, caps, lengths)

    # Junk tokens in the padded positions (inputs and targets) change nothing.
    pad = torch.arange(caps.size(1)).unsqueeze(0) >= lengths.unsqueeze(1)
    assert bool(pad.any())
    junk = caps.clone()
    junk[pad] = torch.randint(4, V, (int(pad.sum()),))
    out2 = dec(feats, junk, lengths)
    torch.testing.assert_close(loss_of(out2, junk, lengths), loss, rtol=0, atol=0)
    mask = target_mask(lengths, out.logits.size(1))
    torch.testing.assert_close(out2.logits[mask], out.logits[mask], rtol=0, atol=0)

    # Arbitrary logits at padded steps change nothing either.
    logits = out.logits.clone()
    logits[~mask] = torch.randn(int((~mask).sum()), V) * 100
    T = logits.size(1)
    torch.testing.assert_close(
        -word_log_likelihoods(logits, caps[:, 1 : T + 1], mask).sum(1).mean(), loss, rtol=0,
        atol=0)


def test_captions_of_different_lengths_match_one_by_one() -> None:
    """A mixed-length batch gives each caption the log-likelihood it gets on its own."""
    torch.manual_seed(3)
    dec = make_decoder().eval()
    feats, caps, lengths = random_batch(5, seed=3)
    assert len(set(lengths.tolist())) > 1
    out = dec(feats, caps, lengths)
    batch_ll = caption_word_log_likelihoods(out.logits, caps, lengths)[0].sum(1)
    for i in range(5):
        n = int(lengths[i])
        one = dec(feats[i : i + 1], caps[i : i + 1, :n], lengths[i : i + 1])
        ll = caption_word_log_likelihoods(one.logits, caps[i : i + 1, :n], lengths[i : i + 1])[0]
        ll = ll.sum(1)
        torch.testing.assert_close(batch_ll[i : i + 1], ll, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.alphas[i, : n - 1], one.alphas[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_unsorted_batch_matches_sorted(attention: str) -> None:
    """The decoder sorts by length internally; outputs come back in the caller's order."""
    torch.manual_seed(4)
    dec = make_decoder(attention=attention, hard_decode="argmax").eval()  # deterministic
    feats, caps, lengths = random_batch(6, seed=4)
    order = torch.argsort(lengths, descending=True, stable=True)
    ref = dec(feats[order], caps[order], lengths[order])
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    out = dec(feats[order][perm], caps[order][perm], lengths[order][perm])
    torch.testing.assert_close(out.logits, ref.logits[perm], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.alphas, ref.alphas[perm], atol=1e-6, rtol=1e-5)


def test_unsorted_hard_training_keeps_per_item_fields_aligned() -> None:
    """In hard training mode the un-sorting also applies to log-probs, entropies and coins."""
    torch.manual_seed(5)
    dec = make_decoder(attention="hard", semi_sampling_prob=0.5, hard_decode="expected").train()
    caps, lengths = make_captions([[4], [5, 6, 7], [8, 9], [4, 4, 4, 4], [5], [6, 7, 8]])
    feats = torch.randn(6, L, D)
    out = dec(feats, caps, lengths)
    mask = target_mask(lengths, out.alphas.size(1))
    assert bool(out.sampled.any()) and bool((~out.sampled).any())
    # A caption whose coin chose the expected context gets exactly the expected-context logits;
    # one that sampled does not: so `sampled` is returned in the caller's order.
    expected = dec.eval()(feats, caps, lengths)
    for i in range(6):
        same = torch.allclose(out.logits[i][mask[i]], expected.logits[i][mask[i]], atol=1e-6)
        assert same == (not bool(out.sampled[i])), i
    assert torch.all(out.attn_log_probs[~mask] == 0) and torch.all(out.attn_entropy[~mask] == 0)
    assert torch.all(out.attn_entropy[mask] > 0)
    torch.testing.assert_close(out.alphas.sum(-1)[mask], torch.ones(int(mask.sum())))


# -- gradients ----------------------------------------------------------------------------------
def make_module(**net) -> CaptioningModule:
    cfg = dict(vocab_size=V, backbone="resnet18", weights=None, grid_size=None, image_size=64,
               embed_dim=16, hidden_dim=32, attn_dim=16, dropout=0.0)
    cfg.update(net)
    return CaptioningModule(net=CaptionerConfig(**cfg))


def batch_for(images: Tensor, seed: int = 0) -> SimpleNamespace:
    _, caps, lengths = random_batch(images.size(0), seed=seed)
    return SimpleNamespace(images=images, captions=caps, lengths=lengths)


def assert_all_nonzero_grads(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    missing = [n for n, p in named if p.grad is None or not bool(p.grad.abs().gt(0).any())]
    assert not missing, f"parameters without gradient: {missing}"


def test_soft_gradients_reach_every_decoder_parameter_not_the_frozen_encoder() -> None:
    torch.manual_seed(6)
    module = make_module(attention="soft").train()
    feats = torch.randn(4, 4, 512)
    module.losses(batch_for(feats), feats)["loss"].backward()
    dec = list(module.captioner.decoder.named_parameters())
    assert_all_nonzero_grads(dec)
    # Every gradient is also much larger than round-off (no parameter that only sees noise).
    assert min(p.grad.abs().max().item() for _, p in dec) > 1e-6
    for n, p in module.captioner.encoder.named_parameters():
        assert not p.requires_grad and p.grad is None, n


def test_hard_full_objective_reaches_every_parameter() -> None:
    torch.manual_seed(7)
    module = make_module(attention="hard", semi_sampling_prob=0.5).train()
    feats = torch.randn(8, 4, 512)
    parts = module.losses(batch_for(feats, seed=7), feats)
    assert {"reinforce", "attn_entropy", "baseline", "reward"} <= set(parts)  # some sampled
    assert parts["reinforce"].requires_grad and parts["reinforce"].item() != 0.0
    parts["loss"].backward()
    dec = list(module.captioner.decoder.named_parameters())
    assert_all_nonzero_grads(dec)
    assert min(p.grad.abs().max().item() for _, p in dec) > 1e-6
    assert all(p.grad is None for p in module.captioner.encoder.parameters())


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_finetuned_encoder_gets_gradients(attention: str) -> None:
    torch.manual_seed(8)
    module = make_module(attention=attention, finetune_encoder=True,
                         semi_sampling_prob=0.0).train()
    assert module.captioner.encoder.body.training
    images = torch.randn(2, 3, 64, 64)
    module.losses(batch_for(images, seed=8))["loss"].backward()
    assert_all_nonzero_grads(list(module.captioner.named_parameters()))


def test_frozen_encoder_stays_in_eval_mode_and_has_no_grad() -> None:
    enc = CNNEncoder(backbone="resnet18", weights=None, grid_size=None, trainable=False)
    enc.train()
    assert not enc.body.training  # BatchNorm statistics stay fixed
    x = torch.randn(2, 3, 64, 64, requires_grad=True)
    feats = enc(x)
    assert not feats.requires_grad
    assert all(not p.requires_grad for p in enc.parameters())


# -- overfitting --------------------------------------------------------------------------------
def test_overfits_four_captions_and_greedy_reproduces_them() -> None:
    torch.manual_seed(9)
    words = [[4, 5, 6], [7, 8], [5, 5, 9, 4, 10], [11]]
    caps, lengths = make_captions(words)
    feats = torch.randn(4, L, D)
    dec = make_decoder()
    opt = torch.optim.Adam(dec.parameters(), lr=1e-2)
    first = None
    for _ in range(200):
        loss = loss_of(dec(feats, caps, lengths), caps, lengths)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05 < first  # summed NLL per caption
    dec.eval()
    gen = greedy_search(dec, feats, max_len=10)
    assert gen.finished.all()
    for i, w in enumerate(words):
        n = int(gen.lengths[i])
        assert gen.tokens[i, :n].tolist() == [*w, END]
        assert torch.all(gen.tokens[i, n:] == PAD)


# -- encoder ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("backbone", "dim"), [("vgg19", 512), ("resnet50", 2048),
                                               ("mobilenet_v2", 1280)])
def test_encoder_grid(backbone: str, dim: int) -> None:
    torch.manual_seed(10)
    enc = CNNEncoder(backbone=backbone, weights=None, grid_size=14)
    out = enc(torch.randn(1, 3, 64, 64))  # adaptive pooling gives 14×14 at any input size
    assert out.shape == (1, 14 * 14, dim)
    assert enc.dim == dim and enc.grid_shape(64) == (14, 14)
    assert torch.isfinite(out).all()


def test_encoder_without_pooling_keeps_the_stride_grid() -> None:
    enc = CNNEncoder(backbone="resnet18", weights=None, grid_size=None)
    assert enc(torch.randn(1, 3, 96, 96)).shape == (1, 9, 512)
    assert enc.grid_shape(96) == (3, 3)


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_grid_shape_is_the_bodys_at_any_size(backbone: str) -> None:
    """The grid that pointing and the overlays reshape α into is the one the body gives,
    also where the size is no multiple of the stride (VGG's max-pools round down, the
    others' padded strides up). Shapes only: built and run on the meta device."""
    with torch.device("meta"):
        enc = CNNEncoder(backbone=backbone, weights=None, grid_size=None)
        for size in (200, 224, 250, 257):
            L = enc(torch.empty(1, 3, size, size)).size(1)
            gh, gw = enc.grid_shape(size)
            assert gh * gw == L, (backbone, size)


def test_encoder_loads_a_local_weights_file(tmp_path) -> None:
    import torchvision

    torch.manual_seed(11)
    ref = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(ref.state_dict(), path)
    enc = CNNEncoder(backbone="resnet18", weights=str(path), grid_size=None)
    body = dict(enc.body.named_parameters())
    ref_params = dict(ref.named_parameters())
    # The body is a Sequential of the resnet's children: map its names back.
    names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"]
    assert len(body) == sum(1 for n in ref_params if not n.startswith("fc."))
    for name, p in body.items():
        idx, rest = name.split(".", 1)
        torch.testing.assert_close(p, ref_params[f"{names[int(idx)]}.{rest}"], rtol=0, atol=0)
    torch.testing.assert_close(enc.body[1].running_mean, ref.bn1.running_mean, rtol=0, atol=0)
    # A checkpoint-style {"state_dict": ...} file works too.
    torch.save({"state_dict": ref.state_dict()}, tmp_path / "wrapped.pt")
    enc2 = CNNEncoder(backbone="resnet18", weights=str(tmp_path / "wrapped.pt"), grid_size=None)
    torch.testing.assert_close(enc2.body[0].weight, ref.conv1.weight, rtol=0, atol=0)


def test_encoder_weight_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown weights 'NOT_A_WEIGHT'"):
        CNNEncoder(backbone="resnet18", weights="NOT_A_WEIGHT")
    with pytest.raises(ValueError, match="unknown backbone"):
        CNNEncoder(backbone="resnet7", weights=None)
    with pytest.raises(FileNotFoundError):
        CNNEncoder(backbone="resnet18", weights=str(tmp_path / "missing.pth"))
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, tmp_path / "partial.pth")
    with pytest.raises(ValueError, match="miss"):
        CNNEncoder(backbone="resnet18", weights=str(tmp_path / "partial.pth"))


def test_the_python_api_names_bad_input_and_settings(caplog: pytest.LogCaptureFixture) -> None:
    """A single image without its batch dimension, integer pixels, a fractional beam size, a
    string width or an unknown score are refused where they are given, naming the problem
    (they failed later: a matrix product, a dtype mismatch, a `<` between str and int); a
    grid finer than the CNN's map warns; `generate` and `captions` decode alike by default."""
    from captioning.models import DecodeConfig
    from captioning.vocab import Vocabulary

    with pytest.raises(ValueError, match=re.escape("decode.beam_size must be a whole number, got 2.5")):
        DecodeConfig(beam_size=2.5)
    with pytest.raises(ValueError, match=re.escape("net.hidden_dim must be a whole number, got '16'")):
        CaptionerConfig.from_dict({"vocab_size": 10, "hidden_dim": "16"})
    assert DecodeConfig(beam_size=np.int64(2)).beam_size == 2  # numpy's integers are whole
    with pytest.raises(ValueError, match=r"net\.score"):
        CaptionerConfig(vocab_size=10, score="cosine")
    net = CaptionerConfig(vocab_size=10, backbone="resnet18", weights=None, grid_size=4,
                          image_size=64, embed_dim=8, hidden_dim=8, attn_dim=8)
    with caplog.at_level("WARNING", logger="captioning.models.captioner"):
        model = Captioner(net).eval()
    assert "net.grid_size 4 is finer than resnet18's 2x2 map at 64 px" in caplog.text
    assert "net.image_size 128 px or more, or net.grid_size 2 or less" in caplog.text
    images = torch.rand(2, 3, 64, 64)
    with pytest.raises(ValueError, match=r"one image needs a batch dimension \(images\[None\]\)"):
        model.generate(images[0])
    with pytest.raises(TypeError, match="float tensor"):
        model.generate((images * 255).to(torch.uint8))
    assert model.generate(model.encode(images)).tokens.shape[0] == 2  # cached grids pass
    model.vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", *"abcdef"])
    model.decode = DecodeConfig(strategy="greedy", max_len=3)
    assert model.generate(images).tokens.shape[1] <= 3 + 1
    assert len(model.captions(images)) == 2
    sampled = DecodeConfig(strategy="sample", max_len=5)
    draws = [model.captions(images, sampled, generator=torch.Generator().manual_seed(1))
             for _ in range(2)]
    assert draws[0] == draws[1]


def test_hard_attention_fields_another_attention_ignores_are_named(
        caplog: pytest.LogCaptureFixture) -> None:
    """Hard-attention fields set away from their defaults warn where the model does not use
    them: every one with soft attention, the Gumbel ones with REINFORCE."""
    base = {"vocab_size": 10, "backbone": "resnet18", "weights": None, "grid_size": None,
            "image_size": 64, "embed_dim": 8, "hidden_dim": 8, "attn_dim": 8}
    cases = [({"semi_sampling_prob": 0.3, "hard_estimator": "gumbel"},
              "no effect with soft attention: net.semi_sampling_prob 0.3, "
              "net.hard_estimator 'gumbel'"),
             ({"attention": "hard", "gumbel_tau_end": 0.2},
              "no effect with hard attention (reinforce): net.gumbel_tau_end 0.2"),
             ({"attention": "hard", "hard_estimator": "gumbel", "gumbel_tau_end": 0.2}, None),
             ({}, None)]
    for fields_, message in cases:
        caplog.clear()
        with caplog.at_level("WARNING", logger="captioning.models.captioner"):
            Captioner(CaptionerConfig(**base, **fields_))
        assert caplog.messages == ([message] if message else []), fields_
    from dataclasses import fields

    from captioning.models.captioner import GUMBEL_ONLY, HARD_ONLY

    # Every field is classified: a new one must be added to a list (here or in the module),
    # so that `unused` cannot miss a hard-only field by forgetting it.
    shared = {"vocab_size", "backbone", "weights", "grid_size", "image_size", "finetune_encoder",
              "channels_last", "embed_dim", "hidden_dim", "attn_dim", "dropout", "attention",
              "score", "n_layers_att", "n_layers_init", "normalizer", "output_tanh",
              "weight_init"}
    assert sorted([*HARD_ONLY, *GUMBEL_ONLY, *shared]) == sorted(
        f.name for f in fields(CaptionerConfig))


def test_capgen_weight_init_follows_the_authors_code() -> None:
    """`weight_init: capgen`: square matrices orthogonal (but the keys' W_a), the others and the
    embedding N(0, 0.01²), the LSTM's U orthogonal gate by gate, biases zero; the encoder keeps
    its own weights; the default keeps PyTorch's."""
    torch.manual_seed(0)
    net = dict(vocab_size=40, backbone="resnet18", weights=None, grid_size=2, image_size=64,
               embed_dim=16, hidden_dim=24, attn_dim=24, n_layers_att=2, n_layers_init=2)
    model = Captioner(CaptionerConfig(**net, weight_init="capgen")).requires_grad_(False)
    dec = model.decoder
    H, E = 24, 16

    def orthogonal(w: torch.Tensor) -> bool:
        return torch.allclose(w @ w.T, torch.eye(w.size(0)), atol=1e-5)

    for g in range(4):
        assert orthogonal(dec.lstm.weight_hh[g * H:(g + 1) * H])
    assert 0.008 < float(dec.lstm.weight_ih[:, E:].std()) < 0.012
    assert 0.008 < float(dec.embed.weight.std()) < 0.012
    assert orthogonal(dec.attention.deep[0].weight)  # W_att_1, square: orthogonal
    assert orthogonal(dec.attention.query.weight)  # W_h, 24 x 24: square
    assert 0.008 < float(dec.attention.key.weight.std()) < 0.012  # W_a (Wc_att), not square
    assert 0.008 < float(dec.out.weight.std()) < 0.012
    assert all(not b.any() for n, b in dec.named_parameters() if "bias" in n)
    # every matrix square where capgen.py could make it so: 512-d grid, E = H = 128, 4H = 512
    square = Captioner(CaptionerConfig(**{**net, "embed_dim": 128, "hidden_dim": 128,
                                          "attn_dim": 512}, weight_init="capgen"))
    lstm, H = square.decoder.lstm, 128
    for g in range(4):
        assert orthogonal(lstm.weight_ih[g * H:(g + 1) * H, :128].detach())  # W, gate by gate
    assert orthogonal(lstm.weight_ih[:, 128:].detach())  # W_c, (4H, D) as one matrix
    key = square.decoder.attention.key.weight.detach()
    assert key.size(0) == key.size(1) and not orthogonal(key)  # Wc_att: square, yet N(0, 0.01²)
    assert 0.008 < float(key.std()) < 0.012
    torch.manual_seed(0)  # the same draws for the encoder, built first: its weights are kept
    plain = Captioner(CaptionerConfig(**net))
    assert float(plain.decoder.embed.weight.detach().std()) > 0.5  # PyTorch's N(0, 1) embedding
    assert all(torch.equal(a, b) for a, b in zip(model.encoder.state_dict().values(),
                                                   plain.encoder.state_dict().values()))
    with pytest.raises(ValueError, match=r"net\.weight_init must be 'torch' or 'capgen', got "
                                         r"'xavier'"):
        CaptionerConfig(**net, weight_init="xavier")
