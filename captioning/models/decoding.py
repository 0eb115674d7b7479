"""Greedy, sampling and batched beam search over `decoder.step()`; the one decoding path.

Beam search keeps the N images × k beams as one batch of N·k rows. Rows of image n are
n·k .. n·k + k - 1 at every step, so the annotation memory is expanded once and never
reordered; only the recurrent state is gathered.

Several captions per image (k samples, or the n best beams) come back image-major: a
`Generation` of N·k rows where rows i·k .. i·k + k - 1 belong to image i (`per_image` = k).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from captioning.models.state import DecoderState, Memory
from captioning.vocab import Vocabulary

NEG_INF = float("-inf")


class StepDecoder(Protocol):
    def memory(self, features: Tensor) -> Memory: ...
    def init_state(self, memory: Memory) -> DecoderState: ...
    def step(
        self, tokens: Tensor, state: DecoderState, memory: Memory
    ) -> tuple[Tensor, DecoderState, Tensor]: ...


@dataclass
class Generation:
    """Decoded captions for a batch of N images."""

    tokens: Tensor  # (N, T) word ids, <end> included when emitted, then <pad>
    lengths: Tensor  # (N,) emitted tokens, <end> included
    scores: Tensor  # (N,) Σ log p of the emitted tokens (sampling: p over the allowed words)
    alphas: Tensor  # (N, T, L) α of every emitted word, zero past the end
    locations: Tensor  # (N, T) location attended (argmax α, or the hard sample)
    finished: Tensor  # (N,) bool: the caption ended with <end> within max_len
    token_log_probs: Tensor | None = None  # (N, T) log p of each emitted token (sampling)
    per_image: int = 1  # rows per image, image-major: rows i·k .. i·k + k - 1 are image i's

    def first_per_image(self) -> Generation:
        """Row i·k of each image (its best beam, or first sample): one row per image."""
        k = self.per_image
        if k == 1:
            return self
        lp = self.token_log_probs
        return Generation(self.tokens[::k], self.lengths[::k], self.scores[::k],
                          self.alphas[::k], self.locations[::k], self.finished[::k],
                          None if lp is None else lp[::k])


@dataclass(frozen=True)
class SpecialIds:
    """The ids the searches treat apart: `Vocabulary`'s, the same in every vocabulary."""

    pad: int = Vocabulary.pad_id
    start: int = Vocabulary.start_id
    end: int = Vocabulary.end_id
    unk: int = Vocabulary.unk_id


IDS = SpecialIds()


def banned_ids(forbid_unk: bool) -> list[int]:
    """The words no search emits: <pad> and <start>, and <unk> when forbidden."""
    return [IDS.pad, IDS.start, *([IDS.unk] if forbid_unk else [])]


def ban_in_place(log_probs: Tensor, forbid_unk: bool) -> Tensor:
    """`banned_ids` set to -inf in place (the searches that need no gradient), a column at a
    time: no index tensor to build, or copy to the device, at every step."""
    for i in banned_ids(forbid_unk):
        log_probs[:, i] = NEG_INF
    return log_probs


def length_normalised(scores: Tensor, lengths: Tensor, length_penalty: float) -> Tensor:
    """score / length^α; α = 0 ranks by the raw log-probability."""
    if length_penalty == 0.0:
        return scores
    return scores / lengths.to(scores.dtype).clamp_min(1) ** length_penalty


@torch.no_grad()
def greedy_search(
    decoder: StepDecoder,
    features: Tensor,
    *,
    max_len: int = 20,
    forbid_unk: bool = False,
) -> Generation:
    """Argmax word at every step, batched over images; stops when all have emitted <end>."""
    memory = decoder.memory(features)
    state = decoder.init_state(memory)
    N, L = features.size(0), features.size(1)
    device = features.device
    tokens = torch.full((N,), IDS.start, dtype=torch.long, device=device)
    out_tokens = torch.full((N, max_len), IDS.pad, dtype=torch.long, device=device)
    out_alphas = features.new_zeros(N, max_len, L, dtype=torch.float)
    out_locs = torch.zeros(N, max_len, dtype=torch.long, device=device)
    scores = torch.zeros(N, dtype=torch.promote_types(features.dtype, torch.float32),
                         device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    lengths = torch.zeros(N, dtype=torch.long, device=device)
    for t in range(max_len):
        log_probs, state, alpha = decoder.step(tokens, state, memory)
        log_probs = ban_in_place(log_probs, forbid_unk)
        best, tokens = log_probs.max(dim=-1)
        live = ~done
        out_tokens[:, t] = torch.where(live, tokens, IDS.pad)
        out_alphas[:, t] = alpha.float() * live.unsqueeze(1)
        out_locs[:, t] = torch.where(live, state.location, 0)
        scores += torch.where(live, best, 0.0)
        lengths += live.long()
        done |= tokens == IDS.end
        if bool(done.all()):
            break
    T = int(lengths.max().item()) if N else 0
    return Generation(out_tokens[:, :T], lengths, scores, out_alphas[:, :T], out_locs[:, :T], done)


def _allowed(log_probs: Tensor, forbid_unk: bool) -> Tensor:
    """`banned_ids` masked out of place (autograd-safe), renormalised over the words that may
    be emitted."""
    mask = torch.zeros(log_probs.size(-1), dtype=torch.bool, device=log_probs.device)
    mask[banned_ids(forbid_unk)] = True
    return log_probs.masked_fill(mask, NEG_INF).log_softmax(dim=-1)


def _draw(log_probs: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """One word per row from softmax(log_probs / T): (B, V) -> (B,)."""
    probs = (log_probs.detach() / temperature).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def sample_search(
    decoder: StepDecoder,
    features: Tensor,
    *,
    num_samples: int = 1,
    temperature: float = 1.0,
    max_len: int = 20,
    forbid_unk: bool = False,
    grad: bool = False,
    generator: torch.Generator | None = None,
) -> Generation:
    """Draw each word from softmax(logits / T), batched over images; `num_samples` per image.

    Rows are image-major (rows i·k .. i·k + k - 1 are image i's samples), sharing one
    `decoder.memory` per image. `token_log_probs` (N·k, T) and `scores` are log p of the
    drawn words under the model at T = 1, renormalised over the words that may be emitted
    (the policy SCST differentiates); with `grad` they keep their graph under the caller's
    grad mode, else the search runs under no_grad. Hard attention uses the decoder's rule.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    with contextlib.nullcontext() if grad else torch.no_grad():
        memory, state = start_rows(decoder, features, num_samples)
        gen = _sample_loop(decoder, memory, state, temperature=temperature, max_len=max_len,
                           forbid_unk=forbid_unk, generator=generator)
    gen.per_image = num_samples
    return gen


def start_rows(decoder: StepDecoder, features: Tensor, k: int, *,
               repeat_memory: bool = True) -> tuple[Memory, DecoderState]:
    """The memory and initial state of each image, computed once and repeated for its k rows
    (image-major). `repeat_memory` False: the memory stays one row per image (N, ...), for a
    caller that copies it into rows of its own."""
    memory = decoder.memory(features)
    state = decoder.init_state(memory)
    if k == 1:
        return memory, state
    state = type(state)(*(x.repeat_interleave(k, dim=0) for x in state))
    if not repeat_memory:
        return memory, state
    rows = torch.arange(features.size(0), device=features.device).repeat_interleave(k)
    return memory.select(rows), state


def _sample_loop(decoder: StepDecoder, memory: Memory, state: DecoderState, *,
                 temperature: float, max_len: int, forbid_unk: bool,
                 generator: torch.Generator | None) -> Generation:
    """The sampling steps over N rows; per-step outputs are stacked once (autograd-friendly)."""
    N, device = memory.values.size(0), memory.values.device
    tokens = torch.full((N,), IDS.start, dtype=torch.long, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    words_t: list[Tensor] = []
    log_p_t: list[Tensor] = []
    alphas_t: list[Tensor] = []
    locs_t: list[Tensor] = []
    for _ in range(max_len):
        log_probs, state, alpha = decoder.step(tokens, state, memory)
        policy = _allowed(log_probs, forbid_unk)  # (N, V)
        tokens = _draw(policy, temperature, generator)  # (N,)
        live = ~done
        words_t.append(torch.where(live, tokens, IDS.pad))
        log_p_t.append(torch.where(live, policy.gather(1, tokens.unsqueeze(1)).squeeze(1), 0.0))
        alphas_t.append(alpha.detach().float() * live.unsqueeze(1))
        locs_t.append(torch.where(live, state.location, 0))
        done = done | (tokens == IDS.end)
        if bool(done.all()):
            break
    words = torch.stack(words_t, dim=1)  # (N, T)
    lengths = (words != IDS.pad).sum(dim=1)  # <pad> is never drawn
    T = int(lengths.max().item()) if N else 0
    log_p = torch.stack(log_p_t, dim=1)[:, :T]  # (N, T)
    return Generation(words[:, :T], lengths, log_p.sum(dim=1),
                      torch.stack(alphas_t, dim=1)[:, :T], torch.stack(locs_t, dim=1)[:, :T],
                      done, token_log_probs=log_p)


class _Finished:
    """The n best finished hypotheses of each of N images, best first by normalised score."""

    def __init__(self, N: int, n: int, max_len: int, L: int, pad: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.norm = torch.full((N, n), NEG_INF, dtype=dtype, device=device)  # scores: `dtype`
        self.score = torch.full((N, n), NEG_INF, dtype=dtype, device=device)
        f32 = {"dtype": torch.float32, "device": device}  # α, whatever the default dtype
        self.length = torch.zeros(N, n, dtype=torch.long, device=device)
        self.tok = torch.full((N, n, max_len), pad, dtype=torch.long, device=device)  # (N, n, T)
        self.alpha = torch.zeros(N, n, max_len, L, **f32)  # (N, n, T, L)
        self.loc = torch.zeros(N, n, max_len, dtype=torch.long, device=device)  # (N, n, T)

    def keep(self, images: Tensor, slot: Tensor, new: Tensor, norm: Tensor, score: Tensor,
             length: int, tok: Tensor, alpha: Tensor, loc: Tensor) -> None:
        """Images (c,) keep, per slot (c, n), their old hypothesis `slot` or, where `new`, the
        given one (norm, score (c, n); tok, loc (c, n, T); alpha (c, n, T, L))."""
        def take(old: Tensor) -> Tensor:
            index = slot.view(*slot.shape, *([1] * (old.dim() - 2))).expand_as(old)
            return old.gather(1, index)

        def pick(old: Tensor, fresh: Tensor) -> Tensor:
            return torch.where(new.view(*new.shape, *([1] * (old.dim() - 2))), fresh, take(old))

        self.norm[images] = pick(self.norm[images], norm)
        self.score[images] = pick(self.score[images], score)
        self.length[images] = pick(self.length[images], torch.full_like(slot, length))
        self.tok[images] = pick(self.tok[images], tok)
        self.alpha[images] = pick(self.alpha[images], alpha)
        self.loc[images] = pick(self.loc[images], loc)

    def generation(self) -> Generation:
        """N·n rows, image-major, best first."""
        N, n = self.norm.shape
        T = int(self.length.max().item()) if N else 0
        return Generation(self.tok.flatten(0, 1)[:, :T], self.length.flatten(),
                          self.score.flatten(), self.alpha.flatten(0, 1)[:, :T],
                          self.loc.flatten(0, 1)[:, :T], torch.isfinite(self.norm).flatten(),
                          per_image=n)


@dataclass(frozen=True)
class BeamSettings:
    """What a beam search is asked for (`beam_search`'s keywords), checked."""

    beam_size: int = 3
    max_len: int = 20
    length_penalty: float = 0.0
    forbid_unk: bool = False
    num_captions: int = 1

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")
        if not 1 <= self.num_captions <= self.beam_size:
            raise ValueError(f"num_captions must be in [1, beam_size={self.beam_size}], "
                             f"got {self.num_captions}")


def top_candidates(beam_scores: Tensor, log_probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The 2k best one-word extensions of each image's k beams (n, k) by log p (n·k, V): their
    scores, source beams and words, (n, 2k) each. 2k always hold >= k that do not end: <end>
    is one word per beam."""
    (n, k), V = beam_scores.shape, log_probs.size(-1)
    cand = (beam_scores.unsqueeze(-1) + log_probs.view(n, k, V)).view(n, k * V)
    top, index = cand.topk(min(2 * k, k * V), dim=1)
    return top, torch.div(index, V, rounding_mode="floor"), index % V  # integer arithmetic


def end_norms(top: Tensor, word: Tensor, length: Tensor, length_penalty: float,
              searching: Tensor | None = None) -> Tensor:
    """The normalised scores (n, k) of the top k candidates that end (an <end> among them, as in
    fairseq, so k = 1 is greedy; `searching` (n, 1): only for images still searching), -inf
    for the others: what competes with each image's n best finished hypotheses."""
    is_end = (word == IDS.end) & torch.isfinite(top)
    if searching is not None:
        is_end &= searching
    return torch.where(is_end, length_normalised(top, length, length_penalty), NEG_INF)


def live_beams(top: Tensor, src: Tensor, word: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The best k candidates (n, 2k) that did not end: their scores, source beams and words."""
    scores, order = torch.where(word == IDS.end, NEG_INF, top).topk(k, dim=1)  # (n, k)
    return scores, src.gather(1, order), word.gather(1, order)


def search_over(beam_scores: Tensor, worst: Tensor, length: int | Tensor,
                settings: BeamSettings) -> Tensor:
    """(n,) whether no live beam can beat the image's n-th best finished hypothesis (`worst`,
    norm). Raw scores only fall as words are added, so with α > 0 the best a live beam can
    reach is its score normalised by the longest allowed length."""
    best_live = beam_scores.max(dim=1).values
    lp = settings.length_penalty
    bound_len = settings.max_len if lp > 0 else length
    lengths = (bound_len.expand_as(best_live) if isinstance(bound_len, Tensor)
               else torch.full_like(best_live, bound_len))
    return torch.isfinite(worst) & (worst >= length_normalised(best_live, lengths, lp))


@torch.no_grad()
def beam_search(
    decoder: StepDecoder,
    features: Tensor,
    *,
    beam_size: int = 3,
    max_len: int = 20,
    length_penalty: float = 0.0,
    forbid_unk: bool = False,
    num_captions: int = 1,
) -> Generation:
    """Batched beam search (N images × k beams as one batch); the n best hypotheses per image.

    Finished hypotheses are ranked by `length_normalised`. With `num_captions` n > 1 the
    result has N·n rows, image-major and best first (`per_image` = n); n = 1 gives one row per
    image. The search for an image stops once no live beam can still beat its n-th best
    finished one, and its rows leave the batch. Slots with no finished hypothesis by `max_len`
    take the image's best live beams, after its finished ones (`finished` False).
    """
    settings = BeamSettings(beam_size, max_len, length_penalty, forbid_unk, num_captions)
    N, L = features.size(0), features.size(1)
    k, nb, device = beam_size, num_captions, features.device
    memory, state = start_rows(decoder, features, k)  # (N·k, ...)
    alive = torch.arange(N, device=device)  # original index of each image still searching

    tokens = torch.full((N * k,), IDS.start, dtype=torch.long, device=device)
    acc = torch.promote_types(features.dtype, torch.float32)  # scores: at least float32
    beam_scores = torch.full((N, k), NEG_INF, dtype=acc, device=device)
    beam_scores[:, 0] = 0.0  # all beams start identical: keep one live
    hist_tok = torch.empty(N, k, 0, dtype=torch.long, device=device)
    hist_alpha = torch.empty(N, k, 0, L, dtype=torch.float32, device=device)
    hist_loc = torch.empty(N, k, 0, dtype=torch.long, device=device)
    fin = _Finished(N, nb, max_len, L, IDS.pad, device, acc)

    for t in range(max_len):
        n = alive.numel()
        log_probs, state, alpha = decoder.step(tokens, state, memory)
        log_probs = ban_in_place(log_probs, forbid_unk)
        top_scores, src_beam, word = top_candidates(beam_scores, log_probs)  # (n, 2k)
        length = t + 1

        # Finished candidates compete with each image's n best finished hypotheses so far; a
        # stable sort keeps the older one on ties.
        norm = end_norms(top_scores[:, :k], word[:, :k], torch.full_like(word[:, :k], length),
                         length_penalty)  # (n, k)
        merged = torch.cat([fin.norm[alive], norm], dim=1)  # (n, nb + k)
        order = merged.sort(dim=1, descending=True, stable=True).indices[:, :nb]  # (n, nb)
        changed = (order >= nb).any(dim=1)
        if bool(changed.any()):
            local = changed.nonzero().squeeze(1)
            pick = order[local]  # (c, nb)
            j = (pick - nb).clamp_min(0)  # column among the top k, where new
            b = src_beam[local].gather(1, j)  # (c, nb) beam the new hypothesis extends
            rows = local.unsqueeze(1) * k + b  # (c, nb) rows of this step
            c = local.numel()
            tok = torch.full((c, nb, max_len), IDS.pad, dtype=torch.long, device=device)
            tok[:, :, :t] = hist_tok[local.unsqueeze(1), b]
            tok[:, :, t] = IDS.end
            alphas = torch.zeros(c, nb, max_len, L, dtype=torch.float32, device=device)
            alphas[:, :, :t] = hist_alpha[local.unsqueeze(1), b]
            alphas[:, :, t] = alpha[rows].float()
            locs = torch.zeros(c, nb, max_len, dtype=torch.long, device=device)
            locs[:, :, :t] = hist_loc[local.unsqueeze(1), b]
            locs[:, :, t] = state.location[rows]
            fin.keep(alive[local], pick.clamp_max(nb - 1), pick >= nb,
                     merged[local].gather(1, pick), top_scores[local].gather(1, j), length,
                     tok, alphas, locs)

        beam_scores, src, new_word = live_beams(top_scores, src_beam, word, k)  # (n, k)
        rows = (torch.arange(n, device=device).unsqueeze(1) * k + src).view(-1)  # (n·k,)
        state = type(state)(*(x.index_select(0, rows) for x in state))
        alpha_rows = alpha.float().index_select(0, rows).view(n, k, 1, L)
        hist_tok = torch.cat([hist_tok.gather(1, src.unsqueeze(-1).expand_as(hist_tok)),
                              new_word.unsqueeze(-1)], dim=2)
        hist_alpha = torch.cat([
            hist_alpha.gather(1, src.view(n, k, 1, 1).expand_as(hist_alpha)), alpha_rows], dim=2)
        hist_loc = torch.cat([hist_loc.gather(1, src.unsqueeze(-1).expand_as(hist_loc)),
                              state.location.view(n, k, 1)], dim=2)
        tokens = new_word.view(-1)

        done = search_over(beam_scores, fin.norm[alive, -1], length, settings)
        if bool(done.all()) or t == max_len - 1:
            break
        if bool(done.any()):  # finished images leave the batch
            keep = (~done).nonzero().squeeze(1)
            keep_rows = (keep.unsqueeze(1) * k + torch.arange(k, device=device)).view(-1)
            alive, beam_scores = alive[keep], beam_scores[keep]
            hist_tok, hist_alpha, hist_loc = hist_tok[keep], hist_alpha[keep], hist_loc[keep]
            memory = memory.select(keep_rows)
            state = type(state)(*(x.index_select(0, keep_rows) for x in state))
            tokens = tokens.index_select(0, keep_rows)

    # Slots still empty (the trailing ones: slots are sorted) take the best live beams.
    missing = ~torch.isfinite(fin.norm[alive])  # (n, nb)
    if bool(missing.any()):
        ranked = beam_scores.sort(dim=1, descending=True, stable=True).indices  # (n, k)
        local, slot = missing.nonzero(as_tuple=True)
        b = ranked[local, slot - (nb - missing.sum(dim=1))[local]]
        g, T = alive[local], hist_tok.size(2)
        fin.tok[g, slot, :T] = hist_tok[local, b]
        fin.alpha[g, slot, :T] = hist_alpha[local, b]
        fin.loc[g, slot, :T] = hist_loc[local, b]
        fin.length[g, slot] = T
        fin.score[g, slot] = beam_scores[local, b]
    return fin.generation()
