"""The code digest that tells an ablation cell's result which code trained it."""

from __future__ import annotations

from pathlib import Path

import captioning
from captioning.provenance import code_digest, source_digest


def test_the_source_digest_changes_with_the_code_only(tmp_path: Path) -> None:
    """Any edit, added or renamed source file changes it; other files, byte-code and the
    order files were written in do not."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "score.py").write_text("x = 1\n")
    (tmp_path / "kernel.cpp").write_text("int f();\n")
    first = source_digest(tmp_path)
    assert len(first) == 12 and int(first, 16) >= 0
    (tmp_path / "config.yaml").write_text("a: 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "score.cpython-311.py").write_text("junk\n")
    assert source_digest(tmp_path) == first
    (tmp_path / "models" / "score.py").write_text("x = 2\n")
    edited = source_digest(tmp_path)
    assert edited != first
    (tmp_path / "models" / "score.py").rename(tmp_path / "models" / "scores.py")
    assert source_digest(tmp_path) not in (first, edited)
    assert code_digest() == source_digest(Path(captioning.__file__).resolve().parent)
