"""Greedy and batched beam search over `decoder.step()`; the one decoding path of the project.

Beam search keeps the N images × k beams as one batch of N·k rows. Rows of image n are
n·k .. n·k + k - 1 at every step, so the annotation memory is expanded once and never
reordered; only the recurrent state is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from captioning.models.decoder import DecoderState, Memory

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
    scores: Tensor  # (N,) Σ log p of the emitted tokens
    alphas: Tensor  # (N, T, L) α of every emitted word, zero past the end
    locations: Tensor  # (N, T) location attended (argmax α, or the hard sample)
    finished: Tensor  # (N,) bool: the caption ended with <end> within max_len


@dataclass(frozen=True)
class SpecialIds:
    pad: int = 0
    start: int = 1
    end: int = 2
    unk: int = 3


def _banned(log_probs: Tensor, ids: SpecialIds, forbid_unk: bool) -> Tensor:
    """Never emit <pad> or <start>; optionally never <unk>."""
    log_probs[:, ids.pad] = NEG_INF
    log_probs[:, ids.start] = NEG_INF
    if forbid_unk:
        log_probs[:, ids.unk] = NEG_INF
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
    ids: SpecialIds = SpecialIds(),
    forbid_unk: bool = False,
) -> Generation:
    """Argmax word at every step, batched over images; stops when all have emitted <end>."""
    memory = decoder.memory(features)
    state = decoder.init_state(memory)
    N, L = features.size(0), features.size(1)
    device = features.device
    tokens = torch.full((N,), ids.start, dtype=torch.long, device=device)
    out_tokens = torch.full((N, max_len), ids.pad, dtype=torch.long, device=device)
    out_alphas = features.new_zeros(N, max_len, L, dtype=torch.float)
    out_locs = torch.zeros(N, max_len, dtype=torch.long, device=device)
    scores = torch.zeros(N, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    lengths = torch.zeros(N, dtype=torch.long, device=device)
    for t in range(max_len):
        log_probs, state, alpha = decoder.step(tokens, state, memory)
        log_probs = _banned(log_probs, ids, forbid_unk)
        best, tokens = log_probs.max(dim=-1)
        live = ~done
        out_tokens[:, t] = torch.where(live, tokens, ids.pad)
        out_alphas[:, t] = alpha.float() * live.unsqueeze(1)
        out_locs[:, t] = torch.where(live, state.location, 0)
        scores += torch.where(live, best, 0.0)
        lengths += live.long()
        done |= tokens == ids.end
        if bool(done.all()):
            break
    T = int(lengths.max().item()) if N else 0
    return Generation(out_tokens[:, :T], lengths, scores, out_alphas[:, :T], out_locs[:, :T], done)


@torch.no_grad()
def beam_search(
    decoder: StepDecoder,
    features: Tensor,
    *,
    beam_size: int = 3,
    max_len: int = 20,
    length_penalty: float = 0.0,
    ids: SpecialIds = SpecialIds(),
    forbid_unk: bool = False,
) -> Generation:
    """Batched beam search (N images × k beams as one batch); best hypothesis per image.

    Finished hypotheses are ranked by `length_normalised`. The search for an image stops
    once no live beam can still beat its best finished one, and its rows leave the batch.
    An image with no finished hypothesis by `max_len` returns its best live beam
    (`finished` False).
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    N, L = features.size(0), features.size(1)
    k, device = beam_size, features.device
    memory = decoder.memory(features)
    memory = type(memory)(*(m.repeat_interleave(k, dim=0) for m in memory))  # (N·k, ...)
    state = decoder.init_state(memory)
    alive = torch.arange(N, device=device)  # original index of each image still searching

    tokens = torch.full((N * k,), ids.start, dtype=torch.long, device=device)
    beam_scores = torch.full((N, k), NEG_INF, device=device)
    beam_scores[:, 0] = 0.0  # all beams start identical: keep one live
    hist_tok = torch.empty(N, k, 0, dtype=torch.long, device=device)
    hist_alpha = torch.empty(N, k, 0, L, device=device)
    hist_loc = torch.empty(N, k, 0, dtype=torch.long, device=device)

    fin_norm = torch.full((N,), NEG_INF, device=device)
    fin_score = torch.full((N,), NEG_INF, device=device)
    fin_len = torch.zeros(N, dtype=torch.long, device=device)
    fin_tok = torch.full((N, max_len), ids.pad, dtype=torch.long, device=device)
    fin_alpha = torch.zeros(N, max_len, L, device=device)
    fin_loc = torch.zeros(N, max_len, dtype=torch.long, device=device)

    for t in range(max_len):
        n = alive.numel()
        log_probs, state, alpha = decoder.step(tokens, state, memory)
        V = log_probs.size(-1)
        log_probs = _banned(log_probs, ids, forbid_unk)
        cand = (beam_scores.unsqueeze(-1) + log_probs.view(n, k, V)).view(n, k * V)
        # 2k candidates always hold >= k that do not end: <end> is one word per beam.
        top_scores, top_idx = cand.topk(min(2 * k, k * V), dim=1)  # (n, 2k)
        src_beam = torch.div(top_idx, V, rounding_mode="floor")  # integer arithmetic only
        word = top_idx % V
        length = t + 1

        # Finished candidates: an <end> among the top k (as in fairseq, so k = 1 is greedy)
        # is compared with each image's best finished hypothesis so far.
        in_top_k = torch.arange(top_idx.size(1), device=device) < k
        is_end = (word == ids.end) & torch.isfinite(top_scores) & in_top_k
        norm = length_normalised(top_scores, torch.full_like(word, length), length_penalty)
        norm = torch.where(is_end, norm, torch.full_like(norm, NEG_INF))
        best_norm, best_j = norm.max(dim=1)  # (n,)
        improve = best_norm > fin_norm[alive]
        if bool(improve.any()):
            local = improve.nonzero().squeeze(1)
            g = alive[local]  # original image indices
            j = best_j[local]
            b = src_beam[local, j]
            rows = local * k + b
            fin_norm[g] = best_norm[local]
            fin_score[g] = top_scores[local, j]
            fin_len[g] = length
            fin_tok[g, :t] = hist_tok[local, b]
            fin_tok[g, t] = ids.end
            fin_tok[g, t + 1 :] = ids.pad
            fin_alpha[g, :t] = hist_alpha[local, b]
            fin_alpha[g, t] = alpha[rows].float()
            fin_alpha[g, t + 1 :] = 0.0
            fin_loc[g, :t] = hist_loc[local, b]
            fin_loc[g, t] = state.location[rows]

        # Live candidates: the best k that did not end.
        live_scores = torch.where(word == ids.end, torch.full_like(top_scores, NEG_INF), top_scores)
        beam_scores, order = live_scores.topk(k, dim=1)  # (n, k)
        src = src_beam.gather(1, order)
        new_word = word.gather(1, order)
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

        # An image is done once no live beam can beat its best finished hypothesis. Raw scores
        # only fall as words are added, so with α >= 0 the best a live beam can reach is its
        # score normalised by the longest allowed length.
        best_live = beam_scores.max(dim=1).values
        bound_len = max_len if length_penalty > 0 else length
        bound = length_normalised(best_live, torch.full_like(best_live, bound_len),
                                  length_penalty)
        done = torch.isfinite(fin_norm[alive]) & (fin_norm[alive] >= bound)
        if bool(done.all()) or t == max_len - 1:
            break
        if bool(done.any()):  # finished images leave the batch
            keep = (~done).nonzero().squeeze(1)
            keep_rows = (keep.unsqueeze(1) * k + torch.arange(k, device=device)).view(-1)
            alive, beam_scores = alive[keep], beam_scores[keep]
            hist_tok, hist_alpha, hist_loc = hist_tok[keep], hist_alpha[keep], hist_loc[keep]
            memory = type(memory)(*(m.index_select(0, keep_rows) for m in memory))
            state = type(state)(*(x.index_select(0, keep_rows) for x in state))
            tokens = tokens.index_select(0, keep_rows)

    # Images still searching with no finished hypothesis: return the best live beam.
    none_local = (~torch.isfinite(fin_norm[alive])).nonzero().squeeze(1)
    if none_local.numel():
        g = alive[none_local]
        b = beam_scores[none_local].argmax(dim=1)
        T = hist_tok.size(2)
        fin_tok[g, :T] = hist_tok[none_local, b]
        fin_alpha[g, :T] = hist_alpha[none_local, b]
        fin_loc[g, :T] = hist_loc[none_local, b]
        fin_len[g] = T
        fin_score[g] = beam_scores[none_local, b]
    finished = torch.isfinite(fin_norm)
    T = int(fin_len.max().item()) if N else 0
    return Generation(fin_tok[:, :T], fin_len, fin_score, fin_alpha[:, :T], fin_loc[:, :T],
                      finished)
