#!/usr/bin/env bash
# Set-up for the quick start: a virtual environment in .venv with hookexp installed (editable), its
# dev tools, the sweep plugins (Optuna, joblib, submitit), transformers/datasets (model=hf, data=hf_disk) and
# lightning (the Lightning callback) and mup (model.parametrization=mup), so that every optional feature's tests run.
#   - mup is installed with --no-deps: its package metadata asks for torchvision and seaborn, which it only
#     needs for its own examples, and PyPI's torchvision would replace a CPU torch by a CUDA build. Runs once; again when
# pyproject.toml changes.
#   - torch is installed first, as the CPU wheel by default (a plain `torch` requirement would pull a
#     multi-GB CUDA build). Bring your own build with HOOKEXP_TORCH="torch==X.Y.Z" (or install torch
#     into .venv yourself before running this): an importable torch is never replaced.
#   - PYTHON picks the interpreter (default: python3, 3.10 or newer).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.hookexp-setup"
want="$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "hookexp: setting up $venv (once) ..." >&2
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet "${HOOKEXP_TORCH:-torch==2.13.0}"
fi
"$venv/bin/python" -m pip install --quiet -e "$root[dev,sweeps,hf,lightning]"
"$venv/bin/python" -m pip install --quiet --no-deps "mup>=1.0"
echo "$want" > "$stamp"
echo "hookexp: set-up done." >&2
