"""DDP on 2 CPU processes (gloo): metrics equal the single-process ones on the same checkpoint.

A tiny model is trained for a few steps and saved; tests/ddp_worker.py then validates and
tests it with `Trainer(devices=2, strategy="ddp")` and this process does the same with one
device. The val/test splits (7 and 5 images) do not divide by 2, so the DistributedSampler pads
them with repeats that the gather must drop. The worker also records the training batches
of each rank (BucketBatchSampler over the DistributedSampler Lightning injects) and how many
attention overlays each rank wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from conftest import needs_java
from ddp_worker import datamodule

from captioning.data.shapes import generate_shapes
from captioning.data.sources import ShapesSource
from captioning.launch import fresh_launch_env
from captioning.lit_module import CaptioningModule
from captioning.models.captioner import CaptionerConfig, DecodeConfig

WORKER = Path(__file__).with_name("ddp_worker.py")
NUM_VAL, NUM_TEST = 7, 5  # odd: the DistributedSampler pads each rank's shard with a repeat


@pytest.fixture(scope="module")
def setup_ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny shapes dataset, a checkpoint trained for a few steps, and the worker's spec."""
    tmp = tmp_path_factory.mktemp("ddp")
    root = generate_shapes(tmp / "shapes", num_train=24, num_val=NUM_VAL, num_test=NUM_TEST,
                           image_size=64, seed=1)
    source = ShapesSource(root=str(root), num_train=24, num_val=NUM_VAL, num_test=NUM_TEST,
                          image_size=64, seed=1)
    # plain data (the worker reads it from JSON): the source as its class_path / init_args
    data = {"source": source.config(), "image_size": 64, "batch_size": 8, "eval_batch_size": 2,
            "cache_dir": str(tmp / "features")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        L.seed_everything(0)
        dm = datamodule(data)
        net = CaptionerConfig(backbone="resnet18", weights=None, grid_size=2, image_size=64,
                              embed_dim=32, hidden_dim=48, attn_dim=32, dropout=0.0)
        module = CaptioningModule(vocab_size=dm.vocab_size, net=net, decoder_lr=1e-2,
                                  decode=DecodeConfig(beam_size=2, max_len=16))
        trainer = L.Trainer(max_steps=40, limit_val_batches=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu", devices=1,
                            default_root_dir=str(tmp))
        trainer.fit(module, datamodule=dm)
        ckpt = tmp / "tiny.ckpt"
        trainer.save_checkpoint(ckpt)
    finally:
        torch.set_num_threads(threads)
    spec = {"data": data, "checkpoint": str(ckpt), "root": str(tmp / "ddp_run"),
            "overlay_dir": str(tmp / "overlays")}
    (tmp / "spec.json").write_text(json.dumps(spec))
    return {"tmp": tmp, "spec": spec, "data": data, "num_pairs": len(dm.dataset_for("train"))}


def _single_process(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dm = datamodule(spec["data"])
        module = CaptioningModule.load_from_checkpoint(spec["checkpoint"], map_location="cpu")
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(tmp / "single"))
        trainer.validate(module, datamodule=dm, verbose=False)
        trainer.test(module, datamodule=dm, verbose=False)
    finally:
        torch.set_num_threads(threads)
    return {split: {"metrics": r.metrics, "hypotheses": {str(k): v for k, v in
                                                         r.hypotheses.items()}}
            for split, r in (("val", module.val_results), ("test", module.test_results))}


@pytest.fixture(scope="module")
def ddp_results(setup_ddp: dict[str, Any]) -> dict[str, Any]:
    tmp = setup_ddp["tmp"]
    out = tmp / "ddp.json"
    env = {**fresh_launch_env(os.environ), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(WORKER.parent.parent)}
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp / "spec.json"), str(out)],
                          env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@needs_java
def test_ddp_metrics_equal_single_process(setup_ddp: dict[str, Any],
                                          ddp_results: dict[str, Any]) -> None:
    single = _single_process(setup_ddp["spec"], setup_ddp["tmp"])
    assert ddp_results["world_size"] == 2
    for split, n in (("val", NUM_VAL), ("test", NUM_TEST)):
        ddp, one = ddp_results[split], single[split]
        assert len(one["hypotheses"]) == n
        assert ddp["hypotheses"] == one["hypotheses"]  # every image once, same captions
        assert set(one["metrics"]) >= {"BLEU-4", "METEOR", "ROUGE-L", "CIDEr",
                                       "objects_correct", "pointing_accuracy"}
        assert one["metrics"]["BLEU-1"] > 0  # the model learnt something to compare
        assert ddp["metrics"] == pytest.approx(one["metrics"], rel=1e-9, abs=1e-12)


def test_ddp_samplers_shard_and_bucket(setup_ddp: dict[str, Any],
                                       ddp_results: dict[str, Any]) -> None:
    s = ddp_results["samplers"]
    assert [r["is_bucketed"] for r in s] == [True, True]
    assert {r["inner_sampler"] for r in s} == {"DistributedSampler"}
    assert {r["val_sampler"] for r in s} == {"DistributedSampler"}
    per_rank = [[i for b in r["batches"] for i in b] for r in s]
    n = setup_ddp["num_pairs"]
    assert len(s[0]["batches"]) == len(s[1]["batches"])  # same step count: no rank hangs
    assert len(per_rank[0]) == len(per_rank[1]) == -(-n // 2)
    assert set(per_rank[0]) | set(per_rank[1]) == set(range(n))  # every pair, sharded
    overlap = Counter(per_rank[0]) + Counter(per_rank[1])
    assert sum(overlap.values()) - n == 2 * -(-n // 2) - n  # only the padding repeats
    dm = datamodule(setup_ddp["data"])
    lengths = dm.dataset_for("train").lengths
    for r in s:  # each batch is one bucket, longest first
        for b in r["batches"]:
            assert list(lengths[b]) == sorted(lengths[b], reverse=True)


def test_overlays_on_rank_zero_only(ddp_results: dict[str, Any]) -> None:
    assert ddp_results["overlays_per_rank"] == [2, 0]


class Rank:
    """A Lightning strategy's rank for `rank_zero_result`: rank zero's broadcast is `told`."""

    def __init__(self, zero: bool, told: Any = None) -> None:
        self.is_global_zero, self.told, self.sent = zero, told, []

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.sent.append(obj)
        return obj if self.is_global_zero else self.told


def test_rank_zeros_result_or_its_interruption_reaches_every_rank() -> None:
    """Only rank zero scores; the others get its scores, or stop at once with its line when it
    was stopped (SIGTERM during scoring), where they would wait for the broadcast till the
    collective's timeout."""
    from captioning.commands.errors import exit_status
    from captioning.distributed import RankZeroFailed, rank_zero_result
    from captioning.locks import Terminated

    calls = []
    zero = Rank(zero=True)
    assert rank_zero_result(zero, lambda: calls.append(0) or {"bleu": 0.5}, what="score") == {
        "bleu": 0.5}
    other = Rank(zero=False, told=zero.sent[0])
    assert rank_zero_result(other, lambda: calls.append(1) or {}, what="score") == {"bleu": 0.5}
    assert calls == [0]  # never run on the other rank

    def stopped() -> dict[str, float]:
        raise Terminated("interrupted by SIGTERM")

    zero = Rank(zero=True)
    with pytest.raises(Terminated):  # its own interruption, once the others are told
        rank_zero_result(zero, stopped, what="score the captions")
    other = Rank(zero=False, told=zero.sent[0])
    with pytest.raises(RankZeroFailed, match="rank zero could not score the captions, so this "
                                             "rank stops: Terminated: interrupted by SIGTERM"
                       ) as caught:
        rank_zero_result(other, stopped, what="score the captions")
    # the same interruption on this rank: it saves the checkpoint and exits as rank zero does
    assert caught.value.interrupt == "SIGTERM"
    assert exit_status(caught.value) == 143
    zero = Rank(zero=True)
    with pytest.raises(ValueError):
        rank_zero_result(zero, lambda: int("x"), what="score")
    with pytest.raises(RankZeroFailed) as caught:
        rank_zero_result(Rank(zero=False, told=zero.sent[0]), dict, what="score")
    assert caught.value.interrupt is None and exit_status(caught.value) == 1  # an error line
