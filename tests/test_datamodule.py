"""The data module: vocabulary, batches, image checks and loaders (on the shapes source)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import shapes_source
from PIL import Image
from torch.utils.data import BatchSampler, DataLoader
from torch.utils.data.distributed import DistributedSampler

from captioning.data.datamodule import CaptionDataModule
from captioning.data.datasets import CaptionBatch
from captioning.data.problems import DataError
from captioning.data.samplers import BucketBatchSampler, ImageBatchSampler
from captioning.data.sources import KarpathySplits
from captioning.vocab import Vocabulary, tokenize


@pytest.fixture
def dm(shapes_dm_kwargs: dict[str, Any]) -> CaptionDataModule:
    return CaptionDataModule(**shapes_dm_kwargs)


def test_vocab_is_available_right_after_init(shapes_dm_kwargs: dict, tmp_path: Path) -> None:
    path = tmp_path / "vocab.json"
    dm = CaptionDataModule(**shapes_dm_kwargs, vocab_path=str(path))
    tokens = [tokenize(c) for r in dm.records("train") for c in r.captions]
    assert dm.vocab == Vocabulary.build(tokens, min_count=1)
    assert dm.vocab_size == len(dm.vocab) and path.is_file()
    assert Vocabulary.load(path) == dm.vocab
    path.write_text(json.dumps({"words": ["<pad>", "<start>", "<end>", "<unk>", "a"]}))
    assert CaptionDataModule(**shapes_dm_kwargs, vocab_path=str(path)).vocab_size == 5
    small = CaptionDataModule(**shapes_dm_kwargs, min_word_count=1000, max_vocab_size=10)
    assert small.vocab_size == 4


def test_a_saved_vocabulary_is_checked_against_this_runs_captions_and_settings(
        shapes_dm_kwargs: dict, shapes_root: Path, tmp_path: Path) -> None:
    """The vocabulary file a run builds records how (its settings and a digest of the training
    captions' word counts). Training with the same loads it; training with other settings or
    other captions stops at `setup("fit")`, with one problem per field naming the file, which
    is kept. Evaluation takes the file as it is, and so does training with a word list that
    records no origin (an exported model's vocab.json)."""
    path = tmp_path / "vocab.json"
    built = CaptionDataModule(**shapes_dm_kwargs, vocab_path=str(path)).vocab
    saved = path.read_bytes()
    assert json.loads(saved)["origin"]["min_count"] == 1
    same = CaptionDataModule(**shapes_dm_kwargs, vocab_path=str(path), validate_images=False)
    same.setup("fit")
    assert same.vocab == built
    other = CaptionDataModule(**shapes_dm_kwargs, vocab_path=str(path), min_word_count=3,
                              max_vocab_size=10, validate_images=False)
    assert other.vocab == built  # loaded as it is: a test or validate run stops here
    other.setup("test")
    assert len(other.dataset_for("train")) > 0  # a split set up on demand (caches): no check
    with pytest.raises(DataError) as e:
        other.setup("fit")
    assert [(p.file, p.entry, p.field) for p in e.value.problems] == [
        (str(path), "origin", "min_count"), (str(path), "origin", "max_size")]
    assert "built with 1, this run's is 3; pass another data.vocab_path" in str(e.value)
    # The same split file with one training image fewer (no image is read).
    data = json.loads((shapes_root / "dataset_shapes.json").read_text())
    next(i for i in data["images"] if i["split"] == "train")["split"] = "test"
    fewer = tmp_path / "fewer.json"
    fewer.write_text(json.dumps(data))
    kwargs = {**shapes_dm_kwargs, "source": KarpathySplits(split_file=str(fewer))}
    with pytest.raises(DataError, match="built from other training captions") as e:
        CaptionDataModule(**kwargs, vocab_path=str(path), min_word_count=1,
                          validate_images=False).setup("fit")
    assert [p.field for p in e.value.problems] == ["counts"]
    assert path.read_bytes() == saved
    # The split file as it was, read by another source class: the same captions, no problem.
    kwargs["source"] = KarpathySplits(split_file=str(shapes_root / "dataset_shapes.json"))
    CaptionDataModule(**kwargs, vocab_path=str(path), min_word_count=1,
                      validate_images=False).setup("fit")
    # The word list edited (a word deleted, or two swapped) under its unchanged origin.
    for edit in ("drop", "swap"):
        damaged = json.loads(saved)
        words_ = damaged["words"]
        if edit == "drop":
            words_.remove("circle")
        else:
            words_[-1], words_[-2] = words_[-2], words_[-1]
        (tmp_path / "damaged.json").write_text(json.dumps(damaged))
        with pytest.raises(DataError) as e:
            CaptionDataModule(**shapes_dm_kwargs, vocab_path=str(tmp_path / "damaged.json"),
                              validate_images=False).setup("fit")
        (problem,) = e.value.problems
        assert (problem.file, problem.entry, problem.field) == (
            str(tmp_path / "damaged.json"), "origin", "words")
        assert problem.message.startswith(
            "1 missing and 0 extra against the words its origin gives ('circle' missing)"
            if edit == "drop" else "the same words in another order")
    # A word list without an origin: used as it is, whatever the settings.
    words = tmp_path / "words.json"
    words.write_text(json.dumps(built.to_dict()))
    listed = CaptionDataModule(**shapes_dm_kwargs, vocab_path=str(words), min_word_count=3,
                               validate_images=False)
    listed.setup("fit")
    assert listed.vocab == built


def _check_batch(batch: CaptionBatch, vocab: Vocabulary) -> None:
    lengths = batch.lengths.tolist()
    assert lengths == sorted(lengths, reverse=True)
    assert batch.captions.shape == (len(batch), max(lengths))
    assert batch.captions.dtype == torch.long and batch.lengths.dtype == torch.long
    for row, n in zip(batch.captions, lengths):
        assert row[0] == vocab.start_id and row[n - 1] == vocab.end_id
        assert (row[n:] == vocab.pad_id).all()
        assert (row[:n] != vocab.pad_id).all()


def test_train_batches(dm: CaptionDataModule) -> None:
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) == 30  # 24 images x 5 captions / 4
    pairs = []
    for batch in batches:
        assert isinstance(batch, CaptionBatch)
        assert batch.images.shape == (len(batch), 3, 64, 64)
        _check_batch(batch, dm.vocab)
        for row, refs, image_id in zip(batch.captions, batch.references, batch.image_ids):
            assert len(refs) == 1
            assert dm.vocab.decode(row.tolist()) == tokenize(refs[0])
            pairs.append((image_id, refs[0]))
    expected = [(r.image_id, c) for r in dm.records("train") for c in r.captions]
    assert sorted(pairs) == sorted(expected)


def test_eval_batches_carry_all_references(dm: CaptionDataModule) -> None:
    dm.setup("validate")
    by_id = {r.image_id: r for r in dm.records("val")}
    seen = []
    for batch in dm.val_dataloader():
        _check_batch(batch, dm.vocab)
        for row, refs, image_id in zip(batch.captions, batch.references, batch.image_ids):
            assert tuple(refs) == by_id[image_id].captions and len(refs) == 5
            assert dm.vocab.decode(row.tolist()) == tokenize(refs[0])
            seen.append(image_id)
    assert sorted(seen) == sorted(by_id)
    dm.setup("test")
    assert sum(len(b) for b in dm.test_dataloader()) == 8


def test_images_are_normalised(dm: CaptionDataModule) -> None:
    x = dm.image_transform(train=False)(Image.new("RGB", (10, 20), (124, 116, 104)))
    assert x.shape == (3, 64, 64)
    assert x.abs().max() < 0.01  # ImageNet mean maps to ~0


def test_max_caption_length_truncates(shapes_dm_kwargs: dict) -> None:
    dm = CaptionDataModule(**shapes_dm_kwargs, max_caption_length=3)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.lengths.max() == 5  # <start> + 3 words + <end>
    row = batch.captions[0].tolist()
    assert dm.vocab.decode(row) == tokenize(batch.references[0][0])[:3]


def test_datasets_pickle_for_workers(dm: CaptionDataModule) -> None:
    dm.setup("fit")
    ds = dm.train_dataloader().dataset
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[3][1], ds[3][1]) and torch.equal(clone[3][0], ds[3][0])


def _copy_with_bad_image(shapes_root: Path, tmp_path: Path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(shapes_root, root)
    (root / "images" / "train_00003.png").write_bytes(b"not a png")
    return root


def test_bad_image_file_fails_or_is_skipped(shapes_dm_kwargs: dict, shapes_root: Path,
                                            tmp_path: Path) -> None:
    root = _copy_with_bad_image(shapes_root, tmp_path)
    kwargs = {**shapes_dm_kwargs, "source": shapes_source(root)}
    with pytest.raises(DataError, match=r"train_00003\.png.*field 'image'.*not an image"):
        CaptionDataModule(**kwargs).setup("fit")
    dm = CaptionDataModule(**kwargs, on_bad_data="skip")
    vocab_before = dm.vocab
    dm.setup("fit")
    assert dm.skipped == {"captions": 0, "images": 0, "image_files": 1}
    assert len(dm.records("train")) == 23
    assert len(dm.train_dataloader().dataset) == 23 * 5
    assert dm.vocab is vocab_before


def test_skipped_annotations_are_counted(shapes_dm_kwargs: dict, shapes_root: Path,
                                         tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(shapes_root, root)
    f = root / "dataset_shapes.json"
    data = json.loads(f.read_text())
    data["images"][0]["sentences"][1]["raw"] = " "
    data["images"][2]["split"] = "holdout"
    f.write_text(json.dumps(data))
    kwargs = {**shapes_dm_kwargs, "source": KarpathySplits(split_file=str(f))}
    with pytest.raises(DataError, match="holdout"):
        _ = CaptionDataModule(**kwargs).vocab
    dm = CaptionDataModule(**kwargs, on_bad_data="skip")
    assert len(dm.records("train")) == 23
    assert dm.skipped == {"captions": 1, "images": 1, "image_files": 0}
    assert len(dm.records("train")[0].captions) == 4


def test_unbucketed_loader(shapes_dm_kwargs: dict) -> None:
    dm = CaptionDataModule(**shapes_dm_kwargs, length_bucketing=False)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert sum(len(b) for b in batches) == 120
    for b in batches:
        _check_batch(b, dm.vocab)


def test_image_grouped_loader(shapes_dm_kwargs: dict) -> None:
    dm = CaptionDataModule(**shapes_dm_kwargs, group_by_image=True)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert sum(len(b) for b in batches) == 120
    images_per_batch = [len(set(b.image_ids)) for b in batches]
    assert max(images_per_batch) <= -(-dm.batch_size // 5) + 1  # 5 captions an image
    for b in batches:
        _check_batch(b, dm.vocab)
        for i, image_id in enumerate(b.image_ids):  # same image, same input rows
            j = b.image_ids.index(image_id)
            assert torch.equal(b.images[i], b.images[j])


@pytest.mark.parametrize("group_by_image", [False, True], ids=["bucketed", "by-image"])
def test_lightning_injects_a_distributed_sampler(dm: CaptionDataModule,
                                                 group_by_image: bool) -> None:
    """Under DDP Lightning rebuilds the batch sampler around a DistributedSampler."""
    from lightning.fabric.utilities.data import _replace_dunder_methods, _set_sampler_epoch
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader

    dm.group_by_image = group_by_image
    dm.setup("fit")
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        loader = dm.train_dataloader()
    assert _is_dataloader_shuffled(loader)
    seen: list[int] = []
    for rank in range(2):
        dist = DistributedSampler(loader.dataset, num_replicas=2, rank=rank, shuffle=True)
        new = _update_dataloader(loader, dist)
        assert isinstance(new.batch_sampler, ImageBatchSampler if group_by_image else
                          BucketBatchSampler)
        assert new.batch_sampler.sampler is dist
        _set_sampler_epoch(new, 4)
        assert new.batch_sampler.epoch == 4
        seen += [i for b in new.batch_sampler for i in b]
    assert sorted(seen) == list(range(len(loader.dataset)))


def test_eval_references_keeps_each_images_first_n(shapes_dm_kwargs: dict) -> None:
    """`eval_references: N`: val and test batches carry each image's first N references (the
    authors' scripts score 5 a COCO image); training pairs and the default are unchanged."""
    full = CaptionDataModule(**shapes_dm_kwargs, validate_images=False, feature_cache=False)
    two = CaptionDataModule(**shapes_dm_kwargs, validate_images=False, feature_cache=False,
                            eval_references=2)
    for dm in (full, two):
        dm.setup("test")
    captions = {r.image_id: list(r.captions) for r in full.records("test")}
    assert max(len(c) for c in captions.values()) > 2  # the cut is seen
    for dm, n in ((full, None), (two, 2)):
        batches = list(dm.test_dataloader())
        assert sum(len(b) for b in batches) == len(captions)
        for b in batches:
            assert b.references == [captions[i][:n] for i in b.image_ids]
    with pytest.raises(ValueError, match="eval_references must be >= 1, got 0"):
        CaptionDataModule(**shapes_dm_kwargs, eval_references=0)
