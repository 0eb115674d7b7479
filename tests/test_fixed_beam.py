"""Beam search over fixed shapes (`captioning.models.fixed_beam`): `decoding.beam_search`'s
captions, scores, α and locations, with every row kept to the end; compiled, one graph."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from test_decoding import make_decoder
from test_gpu import (
    check_fixed_beam_matches_beam_search,
    check_graphs_outlive_eviction_and_cleared_workspaces,
)
from torch import Tensor
from trained import Trained

import captioning.models.native as native
from captioning.commands import caption, predict
from captioning.lit_module import CaptioningModule
from captioning.models.captioner import Captioner, CaptionerConfig, DecodeConfig
from captioning.models.decoding import BeamSettings, Generation, beam_search
from captioning.models.fixed_beam import (
    FastBeamSetting,
    FixedBeamSearch,
    beam_step,
    resolve_fast_beam,
)
from captioning.models.state import Memory

L, D = 5, 16


def assert_same(a: Generation, b: Generation) -> None:
    assert b.per_image == a.per_image
    assert torch.equal(b.tokens, a.tokens)
    assert torch.equal(b.lengths, a.lengths)
    assert torch.equal(b.finished, a.finished)
    assert torch.equal(b.locations, a.locations)
    torch.testing.assert_close(b.scores, a.scores, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.alphas, a.alphas, atol=1e-6, rtol=1e-5)


def tiny_config(**kw: Any) -> CaptionerConfig:
    """A captioner small enough to build in a test (resnet18, 2x2 grid, no weights)."""
    return CaptionerConfig(backbone="resnet18", weights=None, grid_size=2, image_size=32,
                           embed_dim=8, hidden_dim=16, attn_dim=8, vocab_size=12, dropout=0.0,
                           **kw)


def features(n: int, seed: int = 0) -> Tensor:
    return torch.randn(n, L, D, generator=torch.Generator().manual_seed(seed))


CASES = [  # beam, captions, length penalty, max_len, forbid <unk>
    (1, 1, 0.0, 6, False),  # greedy, no caption ends by max_len
    (3, 1, 0.0, 8, False),  # every image done early
    (3, 2, 0.7, 8, True),
    (5, 3, 0.0, 4, False),  # some slots take live beams
    (4, 4, 1.0, 12, False),
]


@pytest.mark.parametrize("attention", ["soft", "hard"])
@pytest.mark.parametrize("k, n, lp, max_len, forbid_unk", CASES)
def test_fixed_shapes_give_beam_searchs_captions(attention: str, k: int, n: int, lp: float,
                                                 max_len: int, forbid_unk: bool) -> None:
    kw = {"attention": "hard", "hard_decode": "argmax"} if attention == "hard" else {}
    dec = make_decoder(1, **kw)
    f = features(6)
    want = beam_search(dec, f, beam_size=k, max_len=max_len, length_penalty=lp,
                       num_captions=n, forbid_unk=forbid_unk)
    got = FixedBeamSearch(dec, "fixed")(f, BeamSettings(k, max_len, lp, forbid_unk, n))
    assert_same(want, got)


def test_the_cases_reach_every_kind_of_slot() -> None:
    """The cases above hold images done before max_len, slots filled by live beams, and
    searches that run to max_len: the paths trace_back takes."""
    dec = make_decoder(1)
    kinds = set()
    for k, n, lp, max_len, forbid_unk in CASES:
        gen = beam_search(dec, features(6), beam_size=k, max_len=max_len, length_penalty=lp,
                          num_captions=n, forbid_unk=forbid_unk)
        kinds |= {"finished" if f else "live" for f in gen.finished.tolist()}
        kinds |= {"short" if int(m) < max_len else "full" for m in gen.lengths}
    assert kinds == {"finished", "live", "short", "full"}


def test_a_smaller_batch_runs_padded_and_gives_its_own_captions() -> None:
    dec = make_decoder(2)
    search = FixedBeamSearch(dec, "fixed")
    settings = BeamSettings(beam_size=3, max_len=10, num_captions=2)
    search(features(8), settings)
    small = features(3, seed=1)
    assert search.rows(3) == 8  # padded up to the 8 seen
    assert_same(beam_search(dec, small, beam_size=3, max_len=10, num_captions=2),
                search(small, settings))
    assert search.rows(1) == 1  # under a quarter of the most: its own size


def test_one_compiled_graph_serves_every_step_and_a_padded_batch(counted_compile: Any
                                                                 ) -> None:
    dec = make_decoder(3)
    search = FixedBeamSearch(dec, "compile")
    settings = BeamSettings(beam_size=3, max_len=8, length_penalty=0.7, num_captions=2)
    for n, seed in ((6, 0), (4, 1), (6, 2)):
        f = features(n, seed)
        assert_same(beam_search(dec, f, **vars(settings)), search(f, settings))
    assert counted_compile.frame_count == 1


@pytest.mark.parametrize("runner", ["fixed", "graphs"])
def test_the_gpu_tests_check_passes_here(runner: str) -> None:
    """tests/test_gpu.py's check (compile and graphs on CUDA), run here uncompiled; `graphs`
    runs its in-place step over static buffers, without capturing it."""
    check_fixed_beam_matches_beam_search("cpu", runner)


def test_the_gpu_tests_eviction_check_passes_here() -> None:
    """tests/test_gpu.py's check of graphs kept through an eviction, run here uncaptured."""
    check_graphs_outlive_eviction_and_cleared_workspaces("cpu")


def test_captioner_generate_uses_the_fast_beam_it_is_given() -> None:
    cfg = tiny_config()
    model = Captioner(cfg).eval()
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    decode = DecodeConfig(beam_size=3, max_len=6, num_captions=2)
    want = model.generate(images, decode)
    model.use_fast_beam("fixed")
    assert isinstance(model.fast_beam, FixedBeamSearch)
    assert_same(want, model.generate(images, decode))
    model.use_fast_beam("off")
    assert model.fast_beam is None
    with pytest.raises(ValueError, match="fast_beam must be"):
        model.use_fast_beam("fast")  # type: ignore[arg-type]
    assert CaptioningModule(net=cfg, fast_beam="compile").captioner.fast_beam is not None


def test_the_commands_offer_every_fast_beam_and_default_to_auto() -> None:
    for main in (caption, predict):
        action = next(a for a in main._parser()._actions if a.dest == "fast_beam")
        assert tuple(action.choices) == typing.get_args(FastBeamSetting)
        assert action.default == "auto"


def test_auto_is_graphs_on_cuda_and_beam_search_elsewhere() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert (resolve_fast_beam("auto", cuda), resolve_fast_beam("auto", cpu)) == ("graphs", "off")
    for setting in ("off", "fixed", "compile", "graphs"):  # the others stand as given
        assert resolve_fast_beam(setting, cpu) == resolve_fast_beam(setting, cuda) == setting
    with pytest.raises(ValueError, match="fast_beam must be"):
        resolve_fast_beam("fast", cpu)
    # a decoder that samples its attended location: random draws, beam_search's own
    assert resolve_fast_beam("auto", cuda, "sample") == "off"
    assert resolve_fast_beam("auto", cuda, "argmax") == "graphs"
    hard = Captioner(tiny_config(attention="hard", hard_decode="sample"))
    assert hard.beam_runner(cuda) is None
    cfg = tiny_config()
    for model in (Captioner(cfg), CaptioningModule(net=cfg).captioner):  # the default: auto
        assert model.fast_beam_setting == "auto"
        assert model.beam_runner(cpu) is None  # beam_search
        search = model.beam_runner(cuda)
        assert isinstance(search, FixedBeamSearch) and search.runner == "graphs"
        assert search.decoder is model.decoder
    model.use_fast_beam("fixed")  # an explicit runner decodes on every device
    assert model.beam_runner(cpu) is model.beam_runner(cuda) is model.fast_beam


def test_caption_and_predict_with_a_fast_beam_give_the_same_captions(
        trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [str(p) for p in trained.images[:5]]
    common = ["--checkpoint", str(trained.checkpoint), "--beam-size", "3", "--max-len", "12"]
    by_caption = []
    for fast in ("off", "fixed"):
        assert caption.main([*common, "--device", "cpu", "--fast-beam", fast, *paths]) == 0
        by_caption.append(capsys.readouterr()[0].splitlines())
    assert by_caption[0] == by_caption[1] and len(by_caption[0]) == 5
    out = tmp_path / "captions.json"
    assert predict.main([*common, "--fast-beam", "fixed", "--out", str(out), "--accelerator",
                         "cpu", "--num-workers", "0", *paths]) == 0
    assert sorted(r["caption"] for r in json.loads(out.read_text())) == \
        sorted(ln.split("\t")[1] for ln in by_caption[0])


def test_a_copy_of_a_search_captures_its_own_graphs() -> None:
    """deepcopy (an averaged model, say) and pickle keep the runner, not the captured graphs
    (CUDA graphs and streams cannot be copied): the copy decodes the same captions."""
    import copy
    import pickle

    cfg = tiny_config()
    model = Captioner(cfg).eval()
    model.use_fast_beam("graphs")  # off CUDA: its in-place step over static buffers
    grids = torch.randn(3, 4, model.encoder.dim,
                        generator=torch.Generator().manual_seed(0))
    decode = DecodeConfig(beam_size=3, max_len=6)
    want = model.generate(grids, decode)
    assert len(model.fast_beam.graphed) == 1  # type: ignore[union-attr]
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        search = twin.fast_beam
        assert isinstance(search, FixedBeamSearch) and search.runner == "graphs"
        assert search.decoder is twin.decoder and not search.graphed and not search.sites
        assert_same(want, twin.generate(grids, decode))
        assert len(search.graphed) == 1
    assert len(model.fast_beam.graphed) == 1  # type: ignore[union-attr]


def test_a_copy_of_a_compiled_search_compiles_its_own_step(counted_compile: Any) -> None:
    """A `compile` runner's step is a compiled function, which pickle cannot name: a copy
    (deepcopy, pickle) drops it and compiles its own, and decodes the same captions."""
    import copy
    import pickle

    dec = make_decoder(3)
    search = FixedBeamSearch(dec, "compile")
    settings = BeamSettings(beam_size=3, max_len=6)
    f = features(4)
    want = search(f, settings)
    for twin in (copy.deepcopy(search), pickle.loads(pickle.dumps(search))):
        assert twin.runner == "compile" and twin.step is not search.step
        assert_same(want, twin(f, settings))
    assert counted_compile.frame_count == 3  # the original's graph, then each copy's own


def test_graphed_buffers_made_under_inference_mode_serve_no_grad_too() -> None:
    """`caption` decodes under inference_mode, `Captioner.captions` under no_grad: the static
    buffers of one GraphedSearch serve both (uncaptured here: the same in-place step)."""
    dec = make_decoder(4)
    search = FixedBeamSearch(dec, "graphs")
    settings = BeamSettings(beam_size=3, max_len=8, num_captions=2)
    f = features(4)
    want = beam_search(dec, f, **vars(settings))
    with torch.inference_mode():
        assert_same(want, search(f, settings))
    with torch.no_grad():
        assert_same(want, search(f, settings))
    assert len(search.graphed) == 1


def test_graphs_copies_each_images_grids_into_its_rows_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`graphs` never repeats the memory for the beams (Memory.select): each call copies the
    images' grids and keys straight into the k rows of its buffers, a new batch's too."""
    dec = make_decoder(9)
    search = FixedBeamSearch(dec, "graphs")
    settings = BeamSettings(beam_size=3, max_len=8, num_captions=2)
    batches = [features(4, seed) for seed in (0, 1)]
    wants = [beam_search(dec, f, **vars(settings)) for f in batches]

    def refuse(*args: Any) -> None:
        raise AssertionError("the memory was repeated before the buffers' copy")

    monkeypatch.setattr(Memory, "select", refuse)
    for f, want in zip(batches, wants):
        assert_same(want, search(f, settings))
    (graphed,) = search.graphed.values()
    keys = dec.attention.project(batches[1])  # (4, L, K): the last batch's, in rows of 3
    assert graphed.memory.keys.shape == (12, *keys.shape[1:])
    assert torch.equal(graphed.memory.keys, keys.repeat_interleave(3, dim=0))
    assert torch.equal(graphed.memory.values, batches[1].repeat_interleave(3, dim=0))


def test_a_graph_is_captured_again_when_the_weights_move_or_the_mode_changes() -> None:
    dec = make_decoder(5)
    search = FixedBeamSearch(dec, "graphs")
    settings = BeamSettings(beam_size=2, max_len=6)
    f = features(3)
    search(f, settings)
    first = next(iter(search.graphed.values()))
    search(f, settings)
    assert list(search.graphed.values()) == [first]  # the same shape: replayed
    dec.double().float()  # a round trip, as Lightning's teardown to the CPU and back: new storage
    assert_same(beam_search(dec, f, **vars(settings)), search(f, settings))
    dec.train()
    search(f, settings)
    dec.eval()
    kept = list(search.graphed.values())  # the first, then one for the new storage, one for train
    assert len(kept) == 3 and kept[0] is first
    for n in (1, 5, 6, 7, 8):  # a fifth batch size: the least recently used goes
        search(features(n), settings)
    assert len(search.graphed) == 4


def test_batches_under_a_quarter_of_the_most_run_at_a_power_of_two() -> None:
    search = FixedBeamSearch(make_decoder(0), "fixed")
    assert [search.rows(n) for n in (100, 30, 25, 24, 9, 3, 1)] == [100, 100, 100, 32, 16, 4, 1]


def test_compile_over_the_native_cpu_kernels_runs_its_steps_uncompiled(
        counted_compile: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Over the kernels the uncompiled step is the faster on the CPU (docs/benchmarks.md,
    part 19): `compile` runs it, and says so once."""
    dec = make_decoder(6)
    dec.use_fast_path("native")
    if dec.fast_path != "native":
        pytest.skip("no native kernels built here")
    search = FixedBeamSearch(dec, "compile")
    settings = BeamSettings(beam_size=3, max_len=8)
    for seed in (0, 1):
        f = features(4, seed)
        assert_same(beam_search(dec, f, **vars(settings)), search(f, settings))
    assert counted_compile.frame_count == 0
    said = [r for r in caplog.records if "run uncompiled" in r.getMessage()]
    assert len(said) == 1  # once


def test_the_native_kernels_step_aside_while_a_step_is_traced(counted_compile: Any) -> None:
    """`native.usable` says no while Dynamo traces: a compiled step over a decoder on the
    native path traces the ATen ops (one graph, no break), and gives the captions of eager
    decoding, which runs the kernels."""
    dec = make_decoder(6)
    dec.use_fast_path("native")
    if dec.fast_path != "native":
        pytest.skip("no native kernels built here")
    search = FixedBeamSearch(dec, "fixed")
    search.step = torch.compile(beam_step, dynamic=False, fullgraph=True)
    settings = BeamSettings(beam_size=3, max_len=8)
    for seed in (0, 1):
        f = features(4, seed)
        assert native.usable(f)  # eager decoding runs the kernels
        assert_same(beam_search(dec, f, **vars(settings)), search(f, settings))
    assert counted_compile.frame_count == 1  # one graph, for every step of both batches


@pytest.mark.slow
def test_inductor_compiles_the_step_to_the_same_captions() -> None:
    """`compile` with Inductor itself (40 s of compiling here cold, 10 s warm): beam_search's
    captions for a batch, and for a smaller one run padded through the same compiled graph."""
    torch._dynamo.reset()
    dec = make_decoder(7)
    search = FixedBeamSearch(dec, "compile")
    settings = BeamSettings(beam_size=3, max_len=8, length_penalty=0.7, num_captions=2)
    for n, seed in ((6, 0), (4, 1)):
        f = features(n, seed)
        assert_same(beam_search(dec, f, **vars(settings)), search(f, settings))
    torch._dynamo.reset()


def test_the_graphs_key_reads_matmul_precision_set_by_either_api() -> None:
    """torch.get_float32_matmul_precision() raises once the legacy and new precision APIs are
    mixed; the key reads the flags themselves."""
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError):  # what the key must not call
            torch.get_float32_matmul_precision()
        search = FixedBeamSearch(make_decoder(8), "graphs")
        search(features(2), BeamSettings(beam_size=2, max_len=4))
        assert len(search.graphed) == 1
    finally:
        matmul.fp32_precision = old
