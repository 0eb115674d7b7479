"""The vocabulary: building, encoding/decoding and its file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captioning.vocab import Vocabulary, tokenize


def test_vocabulary_round_trip(tmp_path: Path) -> None:
    caps = [tokenize("A dog runs."), tokenize("a dog sits"), tokenize("a cat sits")]
    vocab = Vocabulary.build(caps, min_count=1)
    assert vocab.itos[:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert vocab.itos[4:] == ["a", "dog", "sits", "cat", "runs"]  # by count, then alphabet
    ids = vocab.encode(["a", "cat", "flies"])
    assert ids == [vocab.start_id, vocab.stoi["a"], vocab.stoi["cat"], vocab.unk_id,
                   vocab.end_id]
    assert vocab.decode([*ids, vocab.pad_id, vocab.stoi["dog"]]) == ["a", "cat"]
    vocab.save(tmp_path / "v.json")
    assert Vocabulary.load(tmp_path / "v.json") == vocab
    assert Vocabulary.build(caps, min_count=2).itos[4:] == ["a", "dog", "sits"]
    assert len(Vocabulary.build(caps, max_size=6)) == 6


@pytest.mark.parametrize("word", [["x"], 3, None])
def test_a_non_string_word_is_a_clear_error(tmp_path: Path, word: object) -> None:
    f = tmp_path / "vocab.json"
    f.write_text(json.dumps({"words": ["<pad>", "<start>", "<end>", "<unk>", "a", word]}))
    with pytest.raises(ValueError) as info:
        Vocabulary.load(f)
    msg = str(info.value)
    assert msg.startswith(f"{f}: vocabulary word 5 (words[5]) is not a string") and "\n" not in msg


def test_the_tokenizer_keeps_words_of_any_script() -> None:
    """Letters, digits and combining marks of any script make words, and a decomposed accent
    (NFD) gives the same word as a composed one; ASCII text is split as before (underscores and
    punctuation separate)."""
    import unicodedata

    from captioning.data.readers import caption_problem

    assert tokenize("Café jalapeño NAÏVE 一只猫") == ["café", "jalapeño", "naïve", "一", "只", "猫"]
    # Chinese and Japanese have no spaces between words: a character a token; Korean has them
    assert tokenize("一只猫在桌子上。") == ["一", "只", "猫", "在", "桌", "子", "上"]
    assert tokenize("人々が歩いている") == ["人", "々", "が", "歩", "い", "て", "い", "る"]
    assert tokenize("a 猫 sat") == ["a", "猫", "sat"]
    # the punctuation among them is dropped (・ lies among the katakana), half-width kana read
    assert tokenize("「猫・犬」、ｶﾀｶﾅ！") == ["猫", "犬", "ｶ", "ﾀ", "ｶ", "ﾅ"]
    assert tokenize("カ\u3099ラス") == ["ガ", "ラ", "ス"]  # composed as NFC first
    assert tokenize("고양이가 있다") == ["고양이가", "있다"]
    # vowel signs are combining marks, which `\w` leaves out: the words stay whole
    assert tokenize("एक कुत्ता घास पर दौड़ता है") == ["एक", "कुत्ता", "घास", "पर", "दौड़ता", "है"]
    assert tokenize(unicodedata.normalize("NFD", "Café")) == ["café"]
    assert tokenize("A dog's ball_2, isn't it?") == ["a", "dog's", "ball", "2", "isn't", "it"]
    assert caption_problem("一只猫") is None and caption_problem("?!") is not None


def test_the_ascii_fast_path_finds_the_general_patterns_words() -> None:
    """ASCII text skips NFC and the marks (2.5x faster at COCO scale): the same words."""
    import random
    import string

    from captioning.vocab import ASCII_WORD, token_pattern

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 40))).lower()
        assert ASCII_WORD.findall(text) == token_pattern().findall(text), text


def test_the_metrics_spacing_gives_the_tokenizers_words() -> None:
    """`space_cjk` is what coco-caption's PTBTokenizer reads: split on spaces (it lowercases and
    drops its punctuation list itself), it gives `tokenize`'s tokens for text outside ASCII
    (through the tokenizer itself: tests/test_metrics.py, the Chinese captions' scores)."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PUNCTUATIONS

    from captioning.vocab import space_cjk

    for text in ("一只猫在桌子上。", "「猫・犬」、ｶﾀｶﾅ！", "カ\u3099ラス", "人々が歩いている",
                 "Café jalapeño…", "एक कुत्ता दौड़ता है", "a 猫 sat\u3000on", "«le chat» — noir"):
        words = [w for w in space_cjk(text).lower().split() if w not in PUNCTUATIONS]
        assert words == tokenize(text), text
    assert space_cjk("A dog, running.") == "A dog, running."  # ASCII: as it was
