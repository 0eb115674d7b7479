#!/usr/bin/env bash
# The package as a user installs it: build the wheel, install it (not editable) with its
# dependencies in a fresh virtual environment, and use it from a folder outside the checkout.
#
#   bash scripts/check_installed.sh [WORK_DIR]     (default: a temporary folder, removed at exit)
#
# torch and what it requires are hard-linked from the checkout's .venv where they can be
# (scripts/link_installed.py); the other dependencies come from the index `make install` used. The MobileNetV2
# weights the demo config asks for are read from the checkout's $TORCH_HOME (the Makefile's
# .cache/torch), as an offline user would point TORCH_HOME at their own copy.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
if [ -n "${1:-}" ]; then
  WORK="$1"
else  # our own temporary folder (a venv; several GB if torch is installed, not linked): removed at exit
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/captioning-installed.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
fi
PYTHON="${PYTHON:-python3}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
step() { printf '\n== %s\n' "$*"; }

step "build the wheel"
rm -rf "$WORK/dist"
"$PYTHON" -m pip wheel --no-deps -q -w "$WORK/dist" "$REPO" 2>/dev/null \
  || "$REPO/.venv/bin/pip" wheel --no-deps -q -w "$WORK/dist" "$REPO"
WHEEL="$(ls "$WORK"/dist/captioning-*.whl)"
# The listing is read whole (no `unzip -l | grep -q`: grep quitting early kills unzip with
# SIGPIPE, which pipefail turns into a failure). The kernels' sources are built on first use.
"$PYTHON" - "$WHEEL" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
wanted = ["captioning/configs/model/demo_soft.yaml", "captioning/models/native/attention.cpp",
          "captioning/models/native/cell.cpp"]
missing = [name for name in wanted if name not in names]
sys.exit(f"the wheel lacks {missing}" if missing else 0)
PY
echo "$WHEEL"

step "install it in a fresh virtual environment"
rm -rf "$WORK/venv"
"$PYTHON" -m venv "$WORK/venv"
BIN="$WORK/venv/bin"
"$BIN/pip" install -q --upgrade pip
# torch's CUDA build is hard-linked from the checkout's venv when it has the same Python on the
# same file system (a second copy would take 5.5 GB more disk); otherwise pip installs it.
SITE="$("$BIN/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SOURCE="$REPO/.venv/bin/python"
same_python() { [ "$("$1" -c 'import sys; print(sys.version_info[:2])')" = "$("$BIN/python" -c 'import sys; print(sys.version_info[:2])')" ]; }
if [ -x "$SOURCE" ] && same_python "$SOURCE" \
    && "$SOURCE" "$REPO/scripts/link_installed.py" "$SITE" "$REPO/requirements-torch.txt"; then
  echo "torch and what it requires: linked from $REPO/.venv"
else  # a half-linked venv is not used: start it again
  rm -rf "$WORK/venv"
  "$PYTHON" -m venv "$WORK/venv"
  "$BIN/pip" install -q --upgrade pip
fi
"$BIN/pip" install -q -r "$REPO/requirements-torch.txt" || "$BIN/pip" install -q torch torchvision
"$BIN/pip" install -q "$WHEEL"

step "use it from a folder outside the checkout"
rm -rf "$WORK/elsewhere"
mkdir -p "$WORK/elsewhere"
cd "$WORK/elsewhere"
"$BIN/python" -c "
import captioning, pathlib
where = pathlib.Path(captioning.__file__).resolve()
assert 'site-packages' in where.parts, f'not the installed copy: {where}'
print('imports from', where.parent)"
export TORCH_HOME="${TORCH_HOME:-$REPO/.cache/torch}" WANDB_MODE=offline
"$BIN/captioning" --help
"$BIN/captioning" configs
"$BIN/captioning" demo --run-dir run --trainer.max_epochs 1 --samples 2 \
  --data.source.root shapes --data.source.num_train 48 --data.source.num_val 16 \
  --data.source.num_test 16
"$BIN/captioning" export --checkpoint run/checkpoints/last.ckpt --out model
IMAGES=(shapes/images/test_*.png)
"$BIN/captioning" caption --checkpoint run/checkpoints/last.ckpt "${IMAGES[0]}"
"$BIN/captioning" caption --checkpoint model "${IMAGES[@]:0:3}"
"$BIN/captioning" predict --checkpoint model --out captions.json 'shapes/images/test_*.png'
"$BIN/python" -c "import json; r = json.load(open('captions.json')); print(len(r), 'captions in captions.json'); assert len(r) == 16"
step "the installed package works from $WORK/elsewhere"
