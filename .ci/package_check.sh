#!/usr/bin/env bash
# The package as a pip user gets it: build the sdist and the wheel, install the wheel with its
# dependencies in a fresh virtual environment outside the checkout, import zoo, list the models,
# train one tiny epoch through the `zoo-train` console command; then build the API reference.
#
#   bash .ci/package_check.sh [VENV]    (VENV: the checkout's environment, default .venv; it
#                                        needs `build`, from the dev extra; `make package-check`)
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$(pwd)
venv=${1:-.venv}
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/zoo-package-check.XXXXXX")
step() { echo "package check: $* ($((SECONDS - start)) s)"; }
trap 'rm -rf "$work"; step "removed $work"' EXIT

step "building the sdist and the wheel"
"$venv/bin/python" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
ls "$work/dist"

step "installing the wheel in a fresh virtual environment ($work/venv)"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install "$work"/dist/*.whl >"$work/install.log" 2>&1 \
    || { cat "$work/install.log"; exit 1; }
grep "^Successfully installed" "$work/install.log"

cd "$work"  # outside the checkout: only the installed package can be imported
step "importing zoo and listing the models"
"$work/venv/bin/python" - "$checkout" <<'PY'
import sys
from pathlib import Path

import zoo

where = Path(zoo.__file__).resolve()
assert Path(sys.argv[1]).resolve() not in where.parents, f"zoo imported from the checkout: {where}"
names = zoo.list_models()
assert "densenet_bc_100" in names and "resnet50" in names, names
print(f"zoo {zoo.__version__} from {where.parent}: {len(names)} models")
PY

step "one tiny training epoch through zoo-train"
"$work/venv/bin/zoo-train" --model cnn --dataset shapes --image_size 32 --train_size 64 \
    --test_size 32 --batch_size 32 --epochs 1 --device cpu --out_dir "$work/run" \
    >"$work/train.log" 2>&1 || { cat "$work/train.log"; exit 1; }
tail -n 2 "$work/train.log"
grep -q "config from: defaults < .*zoo/train/recipes/cifar_cnn.yaml < command line" \
    "$work/train.log" || { echo "zoo-train did not read the recipe inside the wheel"; exit 1; }
grep -q '"epoch": 1' "$work/run/metrics.jsonl"

cd "$checkout"
step "building the API reference"
make --no-print-directory docs VENV="$venv"
step "done"
