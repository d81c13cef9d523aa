#!/usr/bin/env bash
# `pip install torch-checkpoint-zoo` into an environment that already holds a supported torch
# keeps that torch: build the wheel, install it (with its dependencies, as a user does, no
# constraint file) into VENV, check that torch and torchvision are the versions they were, import
# zoo from outside the checkout and train one tiny epoch through the `zoo-train` command.
#
#   bash .ci/wheel_keeps_torch.sh VENV [BUILD_VENV]   (BUILD_VENV has `build`; default .venv)
#
# .ci/run runs it on the floor's environment (the oldest supported torch), after the core.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(cd "$1" && pwd)
builder=${2:-.venv}
checkout=$(pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/zoo-wheel-keeps-torch.XXXXXX")
trap 'rm -rf "$work"' EXIT
: > "$work/empty-constraints.txt"
versions() { "$venv/bin/python" -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)"; }

"$builder/bin/python" -m build --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
before=$(versions)
PIP_CONSTRAINT="$work/empty-constraints.txt" "$venv/bin/pip" install "$work"/dist/*.whl \
    >"$work/install.log" 2>&1 || { cat "$work/install.log"; exit 1; }
grep "^Successfully installed" "$work/install.log" || true
after=$(versions)
if [[ "$before" != "$after" ]]; then
    echo "wheel: pip moved torch, torchvision from $before to $after; pyproject.toml's floors" \
         "must admit every supported torch"
    exit 1
fi
echo "wheel: installed beside torch, torchvision $after, which pip left as they were"

cd "$work"  # outside the checkout: only the installed package can be imported
"$venv/bin/python" - "$checkout" <<'PY'
import sys
from pathlib import Path

import zoo

where = Path(zoo.__file__).resolve()
assert Path(sys.argv[1]).resolve() not in where.parents, f"zoo imported from the checkout: {where}"
print(f"wheel: zoo {zoo.__version__} from {where.parent}")
PY
"$venv/bin/zoo-train" --model cnn --dataset shapes --image_size 32 --train_size 64 \
    --test_size 32 --batch_size 32 --epochs 1 --device cpu --out_dir "$work/run" \
    >"$work/train.log" 2>&1 || { cat "$work/train.log"; exit 1; }
grep -q '"epoch": 1' "$work/run/metrics.jsonl"
echo "wheel: zoo-train trained one epoch on torch ${after%% *}"
