"""Beam search over fixed shapes, for a GPU: every image's k beams at every step.

`decoding.beam_search` drops an image's rows once its search is over and copies each
finished hypothesis out as it ends: its shapes change from step to step, and it waits on the
device three times a step. `FixedBeamSearch` gives the same captions with every row kept to
the end: a finished image's pool no longer changes (`Carry.done`), each step records its
back-pointers (`Record`), and the captions are traced back once, at the end (`trace_back`).
Its step (`beam_step`) then has the same shapes at every step of every batch (a smaller batch
is padded with images that start done), so it is compiled once (`compile`), or captured as
one CUDA graph and replayed (`graphs`). One wait a step remains: are all images done?
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

import captioning.models.native as native
from captioning.choices import check_choice
from captioning.models.decoding import (
    IDS,
    NEG_INF,
    BeamSettings,
    Generation,
    StepDecoder,
    ban_in_place,
    end_norms,
    live_beams,
    search_over,
    start_rows,
    top_candidates,
)
from captioning.models.fast_path import COMPILE_OPTIONS
from captioning.models.state import DecoderState, Memory

log = logging.getLogger(__name__)

BeamRunner = Literal["fixed", "compile", "graphs"]
FastBeam = Literal["off", "fixed", "compile", "graphs"]  # off: `decoding.beam_search`
# auto: graphs where the grids are on CUDA, off elsewhere
FastBeamSetting = Literal["auto", "off", "fixed", "compile", "graphs"]


def resolve_fast_beam(setting: str, device: torch.device, step_rule: str = "expected"
                      ) -> FastBeam:
    """The beam search for grids on `device`: `auto` is `graphs` on CUDA and `off` elsewhere
    (on the CPU the fixed shapes measured slower), and `off` for a decoder that samples its
    attended location at each step (`step_rule` `sample`: random draws, not captured). On an
    H200, `graphs` ran 1.2 to 2.2x `off`'s captions/s with the same best caption for every
    image, at the paper's size with random weights and `<end>` disabled, so that every caption
    ran 20 steps (docs/benchmarks.md, part 21). The others stand as given."""
    check_choice("fast_beam", setting, FastBeamSetting)
    if setting == "auto":
        return "graphs" if device.type == "cuda" and step_rule != "sample" else "off"
    return setting  # type: ignore[return-value]


class Pool(NamedTuple):
    """Each image's n best finished hypotheses, best first; a hypothesis is traced back from
    the step it ended at and the row whose word was <end>."""

    norm: Tensor  # (N, n) length-normalised score; -inf: no hypothesis yet
    score: Tensor  # (N, n) Σ log p
    length: Tensor  # (N, n) words, <end> included
    step: Tensor  # (N, n) the step of its <end>
    row: Tensor  # (N, n) the beam (of the k) that emitted <end>


class Carry(NamedTuple):
    """What one step hands the next."""

    tokens: Tensor  # (N·k,) each row's last word
    state: DecoderState  # (N·k, ...) the rows' recurrent state
    scores: Tensor  # (N, k) the live beams' Σ log p
    done: Tensor  # (N,) bool: the image's search is over (padding images start done)
    pool: Pool


class Record(NamedTuple):
    """One step's back-pointers: beam j after step t extends row parent[j] with word[j]."""

    alpha: Tensor  # (N, k, L) float32: α of each row at this step
    location: Tensor  # (N, k) the location each row attended
    parent: Tensor  # (N, k) the row each new beam extends
    word: Tensor  # (N, k) the word it adds


def beam_step(decoder: StepDecoder, memory: Memory, carry: Carry, t: Tensor,
              settings: BeamSettings) -> tuple[Carry, Record]:
    """Step t (a 0-d tensor, so that one graph serves every step) of every image's k beams."""
    k, n = settings.beam_size, carry.done.size(0)
    log_probs, state, alpha = decoder.step(carry.tokens, carry.state, memory)
    log_probs = ban_in_place(log_probs, settings.forbid_unk)
    top, src, word = top_candidates(carry.scores, log_probs)  # (n, 2k)
    length = (t + 1).expand(n, k)  # (n, k)
    pool = _pooled(carry, top[:, :k], word[:, :k], src[:, :k], length, t, settings)
    scores, parent, new_word = live_beams(top, src, word, k)  # (n, k)
    rows = (torch.arange(n, device=parent.device).unsqueeze(1) * k + parent).view(-1)
    next_state = type(state)(*(x.index_select(0, rows) for x in state))
    done = carry.done | search_over(scores, pool.norm[:, -1], t + 1, settings)
    record = Record(alpha.float().view(n, k, -1), state.location.view(n, k), parent, new_word)
    return Carry(new_word.view(-1), next_state, scores, done, pool), record


def _pooled(carry: Carry, top: Tensor, word: Tensor, src: Tensor, length: Tensor, t: Tensor,
            settings: BeamSettings) -> Pool:
    """The top k's <end>s (`end_norms`) compete with the image's n best so far; a stable sort
    keeps the older one on ties. A done image's pool stays."""
    old, n = carry.pool, carry.done.size(0)
    norm = end_norms(top, word, length, settings.length_penalty, ~carry.done.unsqueeze(1))
    merged = torch.cat([old.norm, norm], dim=1)  # (n, n_best + k)
    order = merged.sort(dim=1, descending=True, stable=True).indices[:, :settings.num_captions]

    def pick(kept: Tensor, new: Tensor) -> Tensor:
        return torch.cat([kept, new], dim=1).gather(1, order)

    return Pool(merged.gather(1, order), pick(old.score, top), pick(old.length, length),
                pick(old.step, t.expand(n, word.size(1))), pick(old.row, src))


class History(NamedTuple):
    """Every step's `Record`, stacked: (max_len, N, k, ...)."""

    alpha: Tensor
    location: Tensor
    parent: Tensor
    word: Tensor

    @classmethod
    def empty(cls, steps: int, n: int, k: int, L: int, device: torch.device) -> History:
        long = {"dtype": torch.long, "device": device}
        return cls(torch.zeros(steps, n, k, L, dtype=torch.float32, device=device),
                   torch.zeros(steps, n, k, **long), torch.zeros(steps, n, k, **long),
                   torch.zeros(steps, n, k, **long))

    def write(self, t: Tensor, record: Record) -> None:
        """Record step t (0-d) in place; by index_copy_, so that a CUDA graph holds it too."""
        for buf, x in zip(self, record):
            buf.index_copy_(0, t.view(1), x.unsqueeze(0))


def start(decoder: StepDecoder, features: Tensor, settings: BeamSettings, real: int, *,
          repeat_memory: bool = True) -> tuple[Memory, Carry]:
    """The memory of the N·k rows (of the N images, with `repeat_memory` False) and the first
    carry; images from `real` on are padding."""
    N, k, n = features.size(0), settings.beam_size, settings.num_captions
    memory, state = start_rows(decoder, features, k, repeat_memory=repeat_memory)
    device = features.device
    acc = torch.promote_types(features.dtype, torch.float32)  # scores: at least float32
    scores = torch.full((N, k), NEG_INF, dtype=acc, device=device)
    scores[:, 0] = 0.0  # all beams start identical: keep one live
    done = torch.arange(N, device=device) >= real
    zeros = torch.zeros(N, n, dtype=torch.long, device=device)
    pool = Pool(torch.full((N, n), NEG_INF, dtype=acc, device=device),
                torch.full((N, n), NEG_INF, dtype=acc, device=device), zeros, zeros.clone(),
                zeros.clone())
    tokens = torch.full((N * k,), IDS.start, dtype=torch.long, device=device)
    return memory, Carry(tokens, state, scores, done, pool)


def trace_back(carry: Carry, history: History, steps: int, real: int) -> Generation:
    """The n best hypotheses of each of the first `real` images, best first (N·n rows,
    image-major), traced back through the `steps` recorded. Slots with no finished hypothesis
    take the image's best live beams, after its finished ones (`finished` False)."""
    pool, n_best = carry.pool, carry.pool.norm.size(1)
    device = carry.scores.device
    finished = torch.isfinite(pool.norm)  # (N, n); slots are sorted: the empty ones trail
    ranked = carry.scores.sort(dim=1, descending=True, stable=True).indices  # (N, k)
    live_rank = (torch.arange(n_best, device=device) - finished.sum(dim=1, keepdim=True)).clamp_min(0)
    live_beam = ranked.gather(1, live_rank)  # (N, n) the live beam an empty slot takes
    last = torch.full_like(pool.step, steps - 1)
    end = torch.where(finished, pool.step, last)  # (N, n) each slot's last step
    first_word = torch.where(finished, IDS.end, history.word[steps - 1].gather(1, live_beam))
    first_row = torch.where(finished, pool.row, history.parent[steps - 1].gather(1, live_beam))
    N, L = pool.norm.size(0), history.alpha.size(-1)
    tokens = torch.full((N, n_best, steps), IDS.pad, dtype=torch.long, device=device)
    alphas = torch.zeros(N, n_best, steps, L, dtype=torch.float32, device=device)
    locations = torch.zeros(N, n_best, steps, dtype=torch.long, device=device)
    beam = live_beam  # the beam each slot is at after step s, once s < end
    for s in range(steps - 1, -1, -1):
        at_end, before = end == s, end > s
        row = torch.where(at_end, first_row, history.parent[s].gather(1, beam))
        word = torch.where(at_end, first_word, history.word[s].gather(1, beam))
        on = at_end | before
        tokens[:, :, s] = torch.where(on, word, IDS.pad)
        index = row.unsqueeze(-1).expand(N, n_best, L)
        alphas[:, :, s] = history.alpha[s].gather(1, index) * on.unsqueeze(-1)
        locations[:, :, s] = torch.where(on, history.location[s].gather(1, row), 0)
        beam = torch.where(on, row, beam)
    lengths = torch.where(finished, pool.length, steps)
    scores = torch.where(finished, pool.score, carry.scores.gather(1, live_beam))
    T = int(lengths[:real].max().item()) if real else 0
    return Generation(tokens[:real, :, :T].flatten(0, 1), lengths[:real].flatten(),
                      scores[:real].flatten(), alphas[:real, :, :T].flatten(0, 1),
                      locations[:real, :, :T].flatten(0, 1), finished[:real].flatten(),
                      per_image=n_best)


def _tensors(carry: Carry) -> list[Tensor]:
    return [carry.tokens, *carry.state, carry.scores, carry.done, *carry.pool]


def _cloned(carry: Carry) -> Carry:
    return Carry(carry.tokens.clone(), type(carry.state)(*(x.clone() for x in carry.state)),
                 carry.scores.clone(), carry.done.clone(), Pool(*(x.clone() for x in carry.pool)))


class CaptureSite(NamedTuple):
    """Where one `FixedBeamSearch` captures its graphs on a device: one stream and one memory
    pool for all of them. Sharing the pool is safe because no tensor allocated during a capture
    outlives it (every input and output is a search's buffer, allocated before the capture;
    autocast's cache is off; cuBLAS's workspace is the capture's own, `captured`) and replays
    never overlap (each runs on the caller's stream, and `GraphedSearch.run` waits after each).
    On one stream the allocator can reuse a capture's freed intermediates for the next capture
    (it reuses a block only on the stream it was allocated on)."""

    stream: torch.cuda.Stream
    pool: tuple[int, int]  # torch.cuda.graph_pool_handle()

    @classmethod
    def on(cls, device: torch.device) -> CaptureSite:
        with torch.cuda.device(device):
            return cls(torch.cuda.Stream(), torch.cuda.graph_pool_handle())


class GraphedSearch:
    """One batch shape's search over static buffers: each `replay` runs a step, records it,
    moves the carry on in place and counts the step. With a capture `site` (on CUDA) that is
    one CUDA graph's replay; without one the same in-place step runs as it is (the CPU's
    tests). The buffers are ordinary tensors even when made under `inference_mode`, so that a
    later call under `no_grad` can refill them. It takes the memory of the N images (`start`'s
    `repeat_memory` False) and copies each image's into its k rows: one copy of the grids a
    call, where repeating them first would make two and hold both."""

    def __init__(self, decoder: StepDecoder, settings: BeamSettings, memory: Memory,
                 carry: Carry, *, site: CaptureSite | None = None) -> None:
        if memory.rows is not None:
            raise ValueError("GraphedSearch needs the memory of every image (memory.rows is set)")
        self.decoder, self.settings = decoder, settings
        device = carry.done.device
        with torch.inference_mode(False), torch.no_grad():
            self.memory = Memory(*(x.new_empty(x.size(0) * settings.beam_size, *x.shape[1:])
                                   for x in (memory.values, memory.keys)))
            self._fill(memory)
            self.carry = _cloned(carry)
            n, k = carry.scores.shape
            self.history = History.empty(settings.max_len, n, k, memory.values.size(1), device)
            self.t = torch.zeros((), dtype=torch.long, device=device)
            self.all_done = torch.zeros((), dtype=torch.bool, device=device)
        self.replay: Callable[[], object] = self.step
        if site is not None:  # `run` sets every buffer again: the warm-up leaves nothing behind
            self.replay = captured(self.step, site, device).replay

    def step(self) -> None:
        """Step t of the search, in place."""
        new, record = beam_step(self.decoder, self.memory, self.carry, self.t, self.settings)
        self.history.write(self.t, record)
        for kept, fresh in zip(_tensors(self.carry), _tensors(new)):
            kept.copy_(fresh)
        self.all_done.copy_(self.carry.done.all())
        self.t.add_(1)

    def _fill(self, memory: Memory) -> None:
        """Each image's memory (N, ...) into its k rows of the buffers (N·k, ...)."""
        for kept, fresh in ((self.memory.values, memory.values),
                            (self.memory.keys, memory.keys)):
            n = fresh.size(0)
            shape = (n, self.settings.beam_size, *fresh.shape[1:])
            kept.view(shape).copy_(fresh.unsqueeze(1).expand(shape))

    def run(self, memory: Memory, carry: Carry) -> tuple[Carry, History, int]:
        """The search from `carry` over the images' `memory` (N, ...; this graph's shapes):
        carry, history, steps."""
        self._fill(memory)
        for kept, fresh in zip(_tensors(self.carry), _tensors(carry)):
            kept.copy_(fresh)
        self.t.zero_()
        steps = 0
        while steps < self.settings.max_len:
            self.replay()
            steps += 1
            if bool(self.all_done):  # the step's one wait
                break
        return self.carry, self.history, steps


def captured(step: Callable[[], None], site: CaptureSite,
             device: torch.device) -> torch.cuda.CUDAGraph:
    """`step` run once on the site's stream (the warm-up: kernels chosen, libraries loaded),
    then captured as a CUDA graph into the site's pool. cuBLAS's workspaces are dropped before
    and after the capture, as Inductor's CUDA-graph trees do, so that the capture makes its
    own, in the pool, which lives as long as the pool. A graph would otherwise keep the address
    of its stream's workspace, which torch frees when any graph captured on that stream is
    destroyed, and whenever CUDA-graph trees (`fast_path: graphs`) record."""
    with torch.cuda.device(device):
        side = site.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _uncached_autocast():
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        torch._C._cuda_clearCublasWorkspaces()
        try:  # thread_local: the loader's pin-memory thread may call CUDA meanwhile
            with torch.cuda.graph(graph, pool=site.pool, stream=side,
                                  capture_error_mode="thread_local"), _uncached_autocast():
                step()
        finally:
            torch._C._cuda_clearCublasWorkspaces()
    return graph


def _uncached_autocast() -> torch.autocast:
    """The caller's autocast, if any, without its cache of cast weights: a graph captured with
    the cache on would replay casts into memory freed when the caller's autocast exits."""
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                          enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)


def graph_key(decoder: StepDecoder, settings: BeamSettings, memory: Memory) -> tuple[object, ...]:
    """What a captured step depends on besides its buffers' values: the settings, the shapes,
    autocast and matmul precision, the decoder's mode and its weights' addresses (a model
    moved off the device and back holds new ones)."""
    weights = [*decoder.parameters(), *decoder.buffers()] if isinstance(decoder, nn.Module) else []
    matmul = torch.backends.cuda.matmul  # fp32_precision: the legacy reads can raise
    return (settings, tuple(memory.values.shape), memory.values.dtype, tuple(memory.keys.shape),
            memory.keys.dtype, memory.values.device, torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"), matmul.fp32_precision,
            matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction,
            getattr(decoder, "training", None), getattr(decoder, "step_rule", None),
            getattr(decoder, "fast_path", None), tuple((w.data_ptr(), w.dtype) for w in weights))


GRAPHS_KEPT = 4  # captured searches kept, the least recently used dropped first


class FixedBeamSearch:
    """`decoding.beam_search`'s captions by `beam_step` over fixed shapes, run by `runner`:
    `fixed` (uncompiled: what the others must equal), `compile` (one compiled graph for every
    step of a batch shape) or `graphs` (a step captured as a CUDA graph and replayed, the
    `GRAPHS_KEPT` last used kept, all captured on one stream into one memory pool per device:
    `CaptureSite`; off CUDA, the same in-place step uncaptured). A batch of at least a quarter
    of the most images seen runs at that many, the rest padding, so that an epoch's smaller
    last batch needs no graph of its own; a smaller one, at a power of two."""

    def __init__(self, decoder: StepDecoder, runner: BeamRunner = "compile") -> None:
        check_choice("beam runner", runner, BeamRunner)
        self.decoder, self.runner, self.most = decoder, runner, 0
        self.step = self._step_for(runner)
        self.graphed: OrderedDict[tuple[object, ...], GraphedSearch] = OrderedDict()
        self.sites: dict[torch.device, CaptureSite] = {}  # where `_graphed` captures
        self.told_native = False

    @staticmethod
    def _step_for(runner: BeamRunner) -> Callable[..., Any]:
        """`beam_step`, compiled for `compile`."""
        if runner == "compile":
            return torch.compile(beam_step, dynamic=False, fullgraph=True, **COMPILE_OPTIONS)
        return beam_step

    def __getstate__(self) -> dict[str, object]:
        """A copy (deepcopy, pickle) keeps the settings, not the captured graphs or streams
        nor the compiled step (pickle cannot name it): it makes its own on first use."""
        state = {**self.__dict__, "graphed": OrderedDict(), "sites": {}}
        del state["step"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.step = self._step_for(self.runner)

    def rows(self, batch: int) -> int:
        """The images a batch of `batch` runs at."""
        self.most = max(self.most, batch)
        return self.most if 4 * batch >= self.most else 1 << (batch - 1).bit_length()

    @torch.no_grad()
    def __call__(self, features: Tensor, settings: BeamSettings) -> Generation:
        real = features.size(0)
        rows = self.rows(real)
        if rows > real:
            features = torch.cat([features, features.new_zeros(rows - real, *features.shape[1:])])
        graphs = self.runner == "graphs"
        memory, carry = start(self.decoder, features, settings, real, repeat_memory=not graphs)
        if graphs:
            carry, taken, steps = self._graphed(settings, memory, carry).run(memory, carry)
        else:
            taken = History.empty(settings.max_len, rows, settings.beam_size,
                                  features.size(1), features.device)
            carry, steps = self._loop(memory, carry, taken, settings)
        return trace_back(carry, taken, steps, real)

    def _graphed(self, settings: BeamSettings, memory: Memory, carry: Carry) -> GraphedSearch:
        key = graph_key(self.decoder, settings, memory)
        if key in self.graphed:
            self.graphed.move_to_end(key)
            return self.graphed[key]
        while len(self.graphed) >= GRAPHS_KEPT:  # its buffers go before the next one's are made
            self.graphed.popitem(last=False)
        device = memory.values.device
        if device.type == "cuda" and device not in self.sites:
            self.sites[device] = CaptureSite.on(device)
        self.graphed[key] = GraphedSearch(self.decoder, settings, memory, carry,
                                          site=self.sites.get(device))
        return self.graphed[key]

    def _loop(self, memory: Memory, carry: Carry, history: History,
              settings: BeamSettings) -> tuple[Carry, int]:
        step = self.step
        if self.runner == "compile" and getattr(self.decoder, "fast_path", None) == "native" \
                and native.usable(memory.keys):
            # Traced, the step runs the ATen ops in the kernels' place (`native.usable`); on
            # this project's CPU that was 0.83 to 0.90x the uncompiled step over the kernels
            # (docs/benchmarks.md, part 19)
            if not self.told_native:  # once
                log.warning("fast_beam compile: the decoder runs native CPU kernels, faster "
                            "than its compiled step; its beam steps run uncompiled")
                self.told_native = True
            step = beam_step
        t = torch.zeros((), dtype=torch.long, device=carry.done.device)
        steps = 0
        while steps < settings.max_len:
            carry, record = step(self.decoder, memory, carry, t, settings)
            history.write(t, record)
            t, steps = t + 1, steps + 1
            if bool(carry.done.all()):
                break
        return carry, steps
