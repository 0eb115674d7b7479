"""Hard-link installed distributions, and all they require, into another environment.

    python scripts/link_installed.py SITE_PACKAGES REQUIREMENTS_FILE

Run it with the interpreter whose environment holds them (the checkout's .venv).
scripts/check_installed.sh uses it so that its fresh venv does not hold a second copy of
torch's CUDA build (about 5.5 GB): a hard link takes no room, and pip then sees torch as
installed and installs only the rest. Files outside site-packages (console scripts) are left
out, and so are distributions the other environment already has (a venv's own setuptools: one
version's files are never mixed with another's). Exits 1 when a requirement is not installed here or a file cannot be linked (another
file system); the caller then installs normally into a new venv.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

log = logging.getLogger("link_installed")


def requirement_names(lines: list[str]) -> list[str]:
    """The distribution names a requirements file asks for (comments and options skipped)."""
    names = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.append(Requirement(line).name)
    return names


def closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions named, and every one they require under this interpreter,
    the requirements of the extras asked for (cuda-toolkit[cublas,...]) included."""
    seen: dict[str, metadata.Distribution] = {}
    extras_done: set[tuple[str, str]] = set()
    todo = [Requirement(name) for name in names]
    while todo:
        wanted = todo.pop()
        name = canonicalize_name(wanted.name)
        if name not in seen:
            seen[name] = metadata.distribution(name)  # PackageNotFoundError: not installed here
        for extra in {""} | set(wanted.extras):
            if (name, extra) in extras_done:
                continue
            extras_done.add((name, extra))
            for spec in seen[name].requires or []:
                requirement = Requirement(spec)
                if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                    todo.append(requirement)
    return [seen[name] for name in sorted(seen)]


def installed_names(site: Path) -> set[str]:
    """The distributions already installed in `site`."""
    return {canonicalize_name(dist.metadata["Name"]) for dist in metadata.distributions(path=[str(site)])}


def link_distribution(dist: metadata.Distribution, site: Path) -> int:
    """Hard-link the files of `dist` that lie in its site-packages into `site`; how many."""
    root = Path(dist.locate_file("")).resolve()
    linked = 0
    for entry in dist.files or []:
        source = Path(dist.locate_file(entry)).resolve()
        if not source.is_file() or root not in source.parents:
            continue  # a console script in bin/, or a file the RECORD lists but pip never wrote
        target = site / source.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            os.link(source, target)
            linked += 1
    return linked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the other environment's site-packages")
    parser.add_argument("requirements", type=Path, help="a requirements file (torch==...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        dists = closure(requirement_names(args.requirements.read_text().splitlines()))
        present = installed_names(args.site)  # the venv's own pip and setuptools stay its own
        dists = [dist for dist in dists if canonicalize_name(dist.metadata["Name"]) not in present]
        files = sum(link_distribution(dist, args.site) for dist in dists)
    except (metadata.PackageNotFoundError, OSError) as error:
        log.error("cannot link the installed distributions into %s: %s", args.site, error)
        return 1
    log.info("linked %d files of %d distributions into %s (%s)", files, len(dists), args.site,
             ", ".join(sorted(dist.metadata["Name"] for dist in dists)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
