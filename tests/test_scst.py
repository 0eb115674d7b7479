"""Self-critical sequence training: the objective's gradient, baselines and masking, the reward,
`model.init_from`, resuming, and `captioning demo --scst`."""

from __future__ import annotations

import collections
import csv
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from conftest import needs_java, shapes_cli_args
from tiny_runs import BATCHES, REPO, cli_config, user_env
from torch import Tensor

from captioning.cider import CiderD
from captioning.cli import main
from captioning.models import Captioner, CaptionerConfig
from captioning.models.decoding import Generation
from captioning.objectives import SelfCritical, build_objective
from captioning.scst import (
    ScstConfig,
    ScstReward,
    SentenceBleu,
    first_of_each,
    mean_of_others,
    references_of,
    words_only,
)
from captioning.vocab import Vocabulary

pytestmark = pytest.mark.usefixtures("signal_handlers_restored")

WORDS = ["a", "red", "blue", "green", "circle", "square", "big", "small"]
VOCAB = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", *WORDS])
REFS = {10: [["a", "red", "circle"], ["a", "big", "red", "circle"]],
        20: [["a", "blue", "square"], ["small", "blue", "square"]],
        30: [["a", "green", "circle", "and", "a", "square"]]}  # "and": not a model word
L, D = 4, 512


def toy_captioner(seed: int = 0) -> Captioner:
    torch.manual_seed(seed)
    return Captioner(CaptionerConfig(vocab_size=len(VOCAB), backbone="resnet18", grid_size=None,
                                     embed_dim=8, hidden_dim=8, attn_dim=8, dropout=0.0))


def batch_of(image_ids: list[int]) -> SimpleNamespace:
    """Caption pairs of these images (the captions only matter to the cross-entropy part)."""
    B = len(image_ids)
    captions = torch.tensor([[1, 4, 5, 8, 2]] * B)
    return SimpleNamespace(captions=captions, lengths=torch.full((B,), 5), image_ids=image_ids)


class FixedRewards:
    """A stand-in reward: `values` for the sampled rows, `greedy` for the greedy rows; keeps
    the rows it scored."""

    def __init__(self, values: list[float], greedy: float = 0.0) -> None:
        self.values, self.greedy = values, greedy
        self.calls: list[tuple[Tensor, Tensor, list]] = []

    def __call__(self, tokens: Tensor, lengths: Tensor, image_ids: list) -> Tensor:
        self.calls.append((tokens.clone(), lengths.clone(), list(image_ids)))
        n = tokens.size(0)
        sampled = len(self.calls) == 1  # the objective scores its samples first
        values = self.values * (n // len(self.values)) if sampled else [self.greedy] * n
        return torch.tensor(values, dtype=torch.float32)


def scst(rewards: Any, **settings: Any) -> SelfCritical:
    objective = build_objective(attention="soft", objective="scst",
                                scst=ScstConfig(max_len=6, **settings))
    assert isinstance(objective, SelfCritical)
    objective.reward = rewards
    return objective.train()


def policy_log_prob(captioner: Captioner, features: Tensor, tokens: Tensor,
                    lengths: Tensor) -> Tensor:
    """(N,) log p of emitted token rows under the sampling policy (<pad> and <start> banned),
    by teacher forcing."""
    N = tokens.size(0)
    captions = torch.cat([torch.full((N, 1), VOCAB.start_id), tokens], dim=1)
    out = captioner.decoder(features, captions, lengths + 1)
    logits = out.logits.float()
    logits[..., [VOCAB.pad_id, VOCAB.start_id]] = float("-inf")
    lp = logits.log_softmax(-1).gather(2, tokens[:, : logits.size(1)].unsqueeze(2)).squeeze(2)
    mask = torch.arange(lp.size(1)) < lengths.unsqueeze(1)
    return torch.where(mask, lp, 0.0).sum(dim=1)  # <pad> past the end is banned: −inf


# ------------------------------------------------------------------------------------------
# The objective


@pytest.mark.parametrize("baseline", ["mean", "greedy"])
def test_one_step_raises_samples_above_the_baseline_and_lowers_those_below(
        baseline: str) -> None:
    """k = 2 samples per image, rewards 1 and 0: against the other sample's reward (`mean`) or
    a greedy reward of 0.5, the first has a positive advantage and the second a negative one."""
    captioner = toy_captioner()
    features = torch.randn(3, L, D)
    rewards = FixedRewards([1.0, 0.0], greedy=0.5)
    objective = scst(rewards, samples=2, baseline=baseline)
    batch = batch_of([10, 20, 10])  # two images: image 10's second pair is dropped
    parts = objective(captioner.train(), features, batch)
    tokens, lengths, ids = rewards.calls[0]
    assert ids == [10, 10, 20, 20]  # image-major, one row per image
    first = features[[0, 1]].repeat_interleave(2, dim=0)  # (U·k, L, D)
    assert not torch.equal(tokens[0], tokens[1]) or lengths[0] != lengths[1]
    captioner.eval()
    with torch.no_grad():
        before = policy_log_prob(captioner, first, tokens, lengths)
    advantage = torch.tensor([1.0, -1.0] * 2 if baseline == "mean" else [0.5, -0.5] * 2)
    torch.testing.assert_close(parts["loss"].detach(), -(advantage * before).mean(),
                               rtol=1e-4, atol=1e-5)  # −mean((r − b) log p)
    opt = torch.optim.SGD(captioner.parameters(), lr=0.05)
    opt.zero_grad()
    parts["loss"].backward()
    opt.step()
    with torch.no_grad():
        after = policy_log_prob(captioner, first, tokens, lengths)
    change = after - before
    assert bool((change[0::2] > 0).all()), change  # r > b: more likely
    assert bool((change[1::2] < 0).all()), change  # r < b: less likely
    assert float(parts["scst_beat_baseline"]) == 0.5
    assert float(parts["scst_reward"]) == 0.5
    assert float(parts["scst_baseline"]) == 0.5


def test_mean_baseline_excludes_the_sample_itself() -> None:
    """r − b of the other samples' mean is k / (k − 1) times r − (the mean of all k): the signs
    agree, the loss tells them apart."""
    r = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 0.0, 4.0]])
    expected = torch.tensor([[11 / 3, 10 / 3, 3.0, 2.0], [4 / 3, 4 / 3, 4 / 3, 0.0]])
    torch.testing.assert_close(mean_of_others(r), expected)
    rewards = FixedRewards([1.0, 2.0, 3.0, 6.0])
    captioner, features = toy_captioner(), torch.randn(1, L, D)
    parts = scst(rewards, samples=4, baseline="mean")(captioner, features, batch_of([10]))
    assert len(rewards.calls) == 1  # no greedy decode for the mean baseline
    tokens, lengths, _ = rewards.calls[0]
    with torch.no_grad():
        log_p = policy_log_prob(captioner.eval(), features.expand(4, L, D), tokens, lengths)
    advantage = r[0] - expected[0]  # [−8/3, −4/3, 0, 4]
    torch.testing.assert_close(parts["loss"].detach(), -(advantage * log_p).mean(),
                               rtol=1e-4, atol=1e-5)
    assert float(parts["scst_beat_baseline"]) == 0.25  # only 6 beats its baseline (2)


def test_padding_is_masked() -> None:
    """Log-probabilities past a sample's end (here garbage) neither count nor get gradient."""
    k, T = 2, 5
    tokens = torch.tensor([[4, 5, 2, 0, 0], [6, 7, 8, 9, 2]])
    lengths = torch.tensor([3, 5])
    log_probs = torch.randn(k, T).neg().requires_grad_()
    garbage = torch.tensor([[0.0, 0.0, 0.0, 50.0, -70.0], [0.0] * 5])
    gen = Generation(tokens, lengths, torch.zeros(k), torch.zeros(k, T, L),
                     torch.zeros(k, T, dtype=torch.long), torch.tensor([True, True]),
                     token_log_probs=log_probs + garbage, per_image=k)
    captioner = SimpleNamespace(generate=lambda *a, **kw: gen)
    parts = scst(FixedRewards([1.0, 0.0]), samples=k, baseline="mean")(
        captioner, torch.randn(1, L, D), batch_of([10]))
    masked = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    expected = -(torch.tensor([1.0, -1.0]) * (log_probs.detach() * masked).sum(1)).mean()
    torch.testing.assert_close(parts["loss"].detach(), expected)
    parts["loss"].backward()
    assert log_probs.grad is not None
    assert bool((log_probs.grad[0, 3:] == 0).all()) and bool((log_probs.grad[0, :3] != 0).all())
    assert float(parts["scst_sample_len"]) == 3.0  # words, <end> excluded: (2 + 4) / 2


def test_eval_mode_gives_the_cross_entropy_loss() -> None:
    captioner = toy_captioner()
    objective = scst(FixedRewards([1.0]), samples=2).eval()
    parts = objective(captioner.eval(), torch.randn(2, L, D), batch_of([10, 20]))
    assert {"nll", "nll_per_word", "loss"} <= set(parts) and "scst_reward" not in parts


def test_xe_weight_adds_the_cross_entropy_objective() -> None:
    captioner, features = toy_captioner(), torch.randn(2, L, D)
    torch.manual_seed(1)
    plain = scst(FixedRewards([1.0, 0.0]), samples=2)(captioner, features, batch_of([10, 20]))
    torch.manual_seed(1)
    mixed = scst(FixedRewards([1.0, 0.0]), samples=2, xe_weight=0.5)(
        captioner, features, batch_of([10, 20]))
    torch.testing.assert_close(mixed["loss"], plain["loss"] + 0.5 * mixed["xe_loss"])


# ------------------------------------------------------------------------------------------
# The reward


def test_reward_is_cider_d_of_the_words_without_special_tokens() -> None:
    reward = ScstReward(REFS, VOCAB)
    s = VOCAB.stoi
    tokens = torch.tensor([[s["a"], s["red"], VOCAB.unk_id, s["circle"], VOCAB.end_id, 0],
                           [s["a"], s["blue"], s["square"], s["big"], s["square"], s["a"]],
                           [VOCAB.end_id, 0, 0, 0, 0, 0]])
    lengths = torch.tensor([5, 6, 1])  # emitted tokens, <end> included when emitted
    ids = [10, 20, 30]
    words = [VOCAB.decode(row[:n]) for row, n in zip(tokens.tolist(), lengths.tolist())]
    assert words == [["a", "red", "circle"], ["a", "blue", "square", "big", "square", "a"], []]
    expected = CiderD(REFS).score(words, ids)
    torch.testing.assert_close(reward(tokens, lengths, ids), torch.tensor(expected).float())
    assert expected[0] > expected[1] > expected[2] == 0.0
    compact, counts = words_only(tokens, lengths)
    assert counts.tolist() == [3, 6, 0] and compact[0, :3].tolist() == [4, 5, 8]


def test_sentence_bleu_is_pycocoevalcaps(capsys: pytest.CaptureFixture[str]) -> None:
    from pycocoevalcap.bleu.bleu import Bleu

    candidates = [["a", "red", "circle"], ["a", "blue", "square", "big", "square", "a"],
                  ["circle"], [], ["a", "green", "circle", "and", "a", "square"]]
    ids = [10, 20, 10, 30, 30]
    gts = {i: [" ".join(r) for r in REFS[image]] for i, image in enumerate(ids)}
    res = {i: [" ".join(c)] for i, c in enumerate(candidates)}
    _, per_sentence = Bleu(4).compute_score(gts, res)
    capsys.readouterr()  # pycocoevalcap prints its totals
    ours = SentenceBleu(REFS).score(candidates, ids)
    for got, want in zip(ours, per_sentence[3]):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    mixed = ScstReward(REFS, VOCAB, kind="cider_bleu", bleu_weight=0.5)
    s = VOCAB.stoi
    tokens = torch.tensor([[s["a"], s["red"], s["circle"], VOCAB.end_id]])
    r = mixed(tokens, torch.tensor([4]), [10])
    cider = CiderD(REFS).score([["a", "red", "circle"]], [10])[0]
    assert float(r) == pytest.approx(cider + 0.5 * ours[0], rel=1e-6)


def test_references_and_one_row_per_image() -> None:
    records = [SimpleNamespace(image_id=7, captions=("A red circle.", "  ", "Red CIRCLE")),
               SimpleNamespace(image_id=8, captions=("a blue square",))]
    assert references_of(records) == {7: [["a", "red", "circle"], ["red", "circle"]],
                                      8: [["a", "blue", "square"]]}
    assert first_of_each([5, 3, 5, 7, 3]) == ([0, 1, 3], [5, 3, 7])


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="samples must be >= 2"):
        ScstConfig(samples=1, baseline="mean")
    with pytest.raises(ValueError, match="baseline must be"):
        ScstConfig(baseline="average")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="objective must be"):
        build_objective(attention="soft", objective="rl")
    assert ScstConfig.from_dict(ScstConfig(samples=3).to_dict()) == ScstConfig(samples=3)


# ------------------------------------------------------------------------------------------
# Through the CLI: init_from, resuming, logging


def _fit_config(path: Path, shapes_dm_kwargs: dict, cache_dir: Path, ckpt_dir: Path,
                model: dict[str, Any] | None = None, **trainer: Any) -> Path:
    """`cli_config`, with SCST model settings instead of the network when `model` is given."""
    cli_config(path, shapes_dm_kwargs, cache_dir, ckpt_dir, **trainer)
    if model is not None:
        cfg = yaml.safe_load(path.read_text())
        cfg["model"] = model
        path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def cross_entropy(shapes_dm_kwargs: dict, cache_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    """last.ckpt of a one-epoch cross-entropy fit through the CLI (doubly_stochastic 0.3)."""
    root = tmp_path_factory.mktemp("ce")
    cfg = _fit_config(root / "ce.yaml", shapes_dm_kwargs, cache_dir, root / "ckpt")
    assert main(["fit", "--config", str(cfg), "--model.doubly_stochastic", "0.3"]) == 0
    return root / "ckpt" / "last.ckpt"


SCST_MODEL = {"objective": "scst", "scst": {"samples": 2, "baseline": "greedy", "max_len": 6},
              "decoder_lr": 1.0e-3}


def test_init_from_loads_the_weights_and_vocabulary(cross_entropy: Path, shapes_dm_kwargs: dict,
                                                    cache_dir: Path, tmp_path: Path) -> None:
    """A fit of no steps (set up, nothing trained) holds the checkpoint's weights exactly; a data
    setting that would build another vocabulary is overruled by the checkpoint's."""
    from captioning.commands.lightning import lightning_cli

    ckpt = torch.load(cross_entropy, weights_only=True)
    cfg = _fit_config(tmp_path / "scst.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt",
                      model={**SCST_MODEL, "init_from": str(cross_entropy)})
    cli = lightning_cli(["fit", "--config", str(cfg), "--model.decoder_lr", "2e-4",
                         "--trainer.max_steps", "0", "--data.max_vocab_size", "6"])
    model, dm = cli.model, cli.datamodule
    assert cli.trainer.global_step == 0
    assert dm.vocab.to_dict() == ckpt["captioning_vocab"] and len(dm.vocab) > 6
    assert model.vocab == dm.vocab
    state = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("captioner.")}
    for k, v in model.state_dict().items():
        if k in state:
            assert torch.equal(v, state[k]), k
    assert state.keys() <= model.state_dict().keys()
    hp = model.hparams
    assert hp.net == ckpt["hyper_parameters"]["net"] | {"weights": None}
    assert hp.doubly_stochastic == 0.3  # carried over: not set by this config
    assert hp.decoder_lr == 2e-4  # given: the user's (the checkpoint's is 4e-4, the default)
    assert hp.encoder_lr == ckpt["hyper_parameters"]["encoder_lr"]
    assert hp.objective == "scst" and hp.scst["samples"] == 2


def test_resume_from_a_mid_scst_checkpoint(cross_entropy: Path, shapes_dm_kwargs: dict,
                                           cache_dir: Path, tmp_path: Path) -> None:
    """One SCST epoch from init_from, logged to CSV; then `--ckpt_path last` continues it (the
    cross-entropy checkpoint is gone by then: a resumed run does not read init_from)."""
    start = tmp_path / "start.ckpt"
    start.write_bytes(cross_entropy.read_bytes())
    ckpt_dir = tmp_path / "ckpt"
    csv = {"class_path": "lightning.pytorch.loggers.CSVLogger",
           "init_args": {"save_dir": str(tmp_path), "name": "csv"}}
    model = {**SCST_MODEL, "init_from": str(start)}
    first = _fit_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir, model,
                        logger=csv, log_every_n_steps=1)
    assert main(["fit", "--config", str(first)]) == 0
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    assert saved["global_step"] == BATCHES and saved["hyper_parameters"]["objective"] == "scst"
    logged = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    for name in ("train/scst_reward", "train/scst_baseline", "train/scst_beat_baseline",
                 "train/scst_sample_len", "train/attn_entropy", "val/loss"):
        assert name in logged.split(","), name
    start.unlink()
    again = _fit_config(tmp_path / "b.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir, model,
                        max_epochs=2)
    assert main(["fit", "--config", str(again), "--ckpt_path", "last"]) == 0
    resumed = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 2 * BATCHES and resumed["epoch"] == 2


def test_init_from_writes_nothing_into_a_busy_run_folder(
        cross_entropy: Path, shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The run folder is claimed before init_from writes its vocabulary there: a second run
    is refused without touching the first one's files."""
    from captioning.commands.lightning import INIT_FROM_VOCAB
    from captioning.locks import claim_folder

    run = tmp_path / "run"
    cfg = _fit_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, run / "ckpt",
                      model={**SCST_MODEL, "init_from": str(cross_entropy)})
    with claim_folder(run):
        (run / INIT_FROM_VOCAB).write_text("the first run's")
        assert main(["fit", "--config", str(cfg)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "run folder in use by another run" in err[0]
    assert (run / INIT_FROM_VOCAB).read_text() == "the first run's"


def test_init_from_a_missing_file_is_one_line(shapes_dm_kwargs: dict, cache_dir: Path,
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _fit_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt",
                      model={**SCST_MODEL, "init_from": str(tmp_path / "nope.ckpt")})
    assert main(["fit", "--config", str(cfg)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert err == [f"error: {tmp_path / 'nope.ckpt'}: checkpoint file does not exist"]


def test_init_from_refuses_another_network(cross_entropy: Path, shapes_dm_kwargs: dict,
                                           cache_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _fit_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt",
                      model={**SCST_MODEL, "init_from": str(cross_entropy)})
    assert main(["fit", "--config", str(cfg), "--model.net.hidden_dim", "64"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "--model.net.hidden_dim 64 (the checkpoint has 32)" in err[0], err
    assert err[0].endswith("start a new run without model.init_from"), err  # not --ckpt_path


# ------------------------------------------------------------------------------------------
# The demo


@needs_java
def test_demo_scst_runs_both_stages(shapes_root: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "captioning.cli", "demo", "--scst", "--run-dir",
         str(tmp_path / "run"), "--samples", "1", *shapes_cli_args(shapes_root),
         "--data.cache_dir", str(tmp_path / "features"), "--model.net.weights", "null",
         "--model.net.hidden_dim", "32", "--model.decode.max_len", "6",
         "--model.scst.samples", "2", "--trainer.max_epochs", "1",
         "--trainer.limit_train_batches", "2", "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, env=user_env(WANDB_MODE="offline", PYTHONPATH=str(REPO)),
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "Shapes test split (" in text and "Shapes test split after SCST (" in text
    assert "cross-entropy" in text and "SCST" in text
    table = text[text.index("cross-entropy"):].splitlines()
    assert any(ln.split()[:1] == ["CIDEr"] and len(ln.split()) == 5 for ln in table), text
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "Traceback" in ln]
    assert not lines
    assert (tmp_path / "run" / "scst" / "checkpoints" / "last.ckpt").is_file()
    assert collections.Counter(text.splitlines())["Generated captions beside their references:"] == 2


@needs_java
def test_scst_curve_script_trains_seeds_and_draws_the_curve(shapes_root: Path,
                                                           tmp_path: Path) -> None:
    """scripts/scst_curve.py (README): the demo with --scst per seed, then val CIDEr of the
    cross-entropy model (step 0) and of every kept SCST checkpoint; a second call resumes."""
    demo = [*shapes_cli_args(shapes_root), "--data.cache_dir", str(tmp_path / "features"),
            "--model.net.weights", "null", "--model.net.hidden_dim", "32",
            "--model.decode.max_len", "6", "--model.scst.samples", "2",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
            "--trainer.enable_progress_bar", "false"]
    cmd = [sys.executable, str(REPO / "scripts" / "scst_curve.py"), "--seeds", "0",
           "--every", "1", "--run-root", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
           "--", *demo]
    env = user_env(WANDB_MODE="offline", PYTHONPATH=str(REPO))
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "out" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["stage"] for r in rows] == ["cross_entropy", "scst"]
    ce = json.loads((tmp_path / "runs" / "seed0" / "test_metrics.json").read_text())
    assert float(rows[0]["CIDEr"]) == pytest.approx(ce["CIDEr"], abs=1e-4)
    with open(tmp_path / "out" / "curve.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps[0] == 0 and len(steps) >= 2 and steps == sorted(steps)
    assert (tmp_path / "out" / "curve.png").stat().st_size > 0
    assert "| CIDEr |" in (tmp_path / "out" / "table.md").read_text()
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0 and "trained already" in again.stderr


def test_scst_curve_tables_a_metric_some_seeds_lack(tmp_path: Path) -> None:
    """Pointing accuracy is absent where no word was scored, and a CIDEr of 0 has no relative
    change: the table is still written, from the seeds that have each metric."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scst_curve", REPO / "scripts" / "scst_curve.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    figs = {"BLEU-4": 0.5, "METEOR": 0.3, "CIDEr": 0.0, "objects_correct": 0.9}
    results = {0: {"cross_entropy": figs, "scst": {**figs, "CIDEr": 0.2}},
               1: {"cross_entropy": {**figs, "pointing_accuracy": 0.4},
                   "scst": {**figs, "pointing_accuracy": 0.6}}}
    script.write_outputs(tmp_path, results, {0: [(0, {"CIDEr": 0.1})], 1: [(0, {"CIDEr": 0.2})]})
    table = (tmp_path / "table.md").read_text()
    assert "| pointing_accuracy | 0.4000 ± 0.0000 | 0.6000 ± 0.0000 | +0.2000 |" in table
    assert "| CIDEr | 0.0000 ± 0.0000 | 0.1000 ± 0.1414 | +0.1000 |" in table
    assert (tmp_path / "curve.png").is_file()
