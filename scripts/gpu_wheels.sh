#!/usr/bin/env bash
# The wheels of what `make gpu-check` imports that the lent CUDA machine's image lacks
# (jsonargparse, with the extras LightningCLI's signatures need), at this checkout's versions,
# into .whl/ (ignored), to carry there. Run it here, where pip reaches the package registry;
# docs/benchmarks.md ("On a machine lent for a few minutes") has the command that installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"          # whose package versions to pin
TARGET="${GPU_PYTHON_VERSION:-3.12}"          # the image's python3
PACKAGES=(jsonargparse docstring-parser typeshed-client)
mapfile -t pins < <("$PYTHON" - "${PACKAGES[@]}" <<'PY'
import importlib.metadata as m
import sys

for name in sys.argv[1:]:
    print(f"{name}=={m.version(name)}")
PY
)
rm -rf .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" \
  --implementation cp --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
ls .whl
