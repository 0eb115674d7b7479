"""scripts/link_installed.py: the installed-package check shares torch with the checkout's venv."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

from tiny_runs import REPO

SCRIPT = REPO / "scripts" / "link_installed.py"


def _fresh_venv(tmp_path: Path) -> tuple[Path, Path]:
    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site)


def _link(site: Path, requirements: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "requirements.txt").write_text(requirements)
    return subprocess.run([sys.executable, SCRIPT, site, tmp_path / "requirements.txt"],
                          capture_output=True, text=True, timeout=120)


def test_a_requirement_is_linked_with_what_it_requires(tmp_path: Path) -> None:
    python, site = _fresh_venv(tmp_path)
    out = _link(site, "# a comment\njinja2\n", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "of 2 distributions" in out.stderr and "Jinja2, MarkupSafe" in out.stderr
    used = subprocess.run([python, "-c", "import jinja2, markupsafe; from importlib import metadata; "
                           "print(jinja2.__file__); print(metadata.version('markupsafe'))"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert Path(used[0]).is_relative_to(site)  # the fresh venv's copy, not this one's
    from importlib import metadata
    assert used[1] == metadata.version("markupsafe")
    here = Path(metadata.distribution("jinja2").locate_file("jinja2/__init__.py"))
    assert os.path.samefile(used[0], here)  # one file on disk, two names


def test_a_distribution_the_venv_has_is_left_as_it_is(tmp_path: Path) -> None:
    _, site = _fresh_venv(tmp_path)
    own = site / "markupsafe-0.0.dist-info"
    own.mkdir(parents=True)
    (own / "METADATA").write_text("Metadata-Version: 2.1\nName: MarkupSafe\nVersion: 0.0\n")
    out = _link(site, "jinja2\n", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "of 1 distributions" in out.stderr and "MarkupSafe" not in out.stderr
    assert not (site / "markupsafe").exists()  # no files of another version mixed in


def test_a_requirement_not_installed_here_fails_clearly(tmp_path: Path) -> None:
    _, site = _fresh_venv(tmp_path)
    out = _link(site, "no-such-distribution-here==1.0\n", tmp_path)
    assert out.returncode == 1
    assert f"cannot link the installed distributions into {site}" in out.stderr
    assert "no-such-distribution-here" in out.stderr
