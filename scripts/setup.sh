#!/usr/bin/env bash
# Set-up for the quick start: a virtual environment in .venv with hookexp installed (editable) and the package
# extras named in $1 (comma-separated, e.g. dev,sweeps,hf,lightning,docs; none: what the main job needs).
# ./scripts/run.sh installs no extra, ./scripts/test.sh every one the tests use. Runs when pyproject.toml changed
# or an extra asked for is not installed yet; the stamp .venv/.hookexp-setup holds the pyproject.toml hash and
# the extras installed with it ("<hash> dev,hf,..."), so the run command after the test command installs nothing.
#   - torch is installed first, as the CPU wheel by default (a plain `torch` requirement would pull a
#     multi-GB CUDA build). Bring your own build with HOOKEXP_TORCH="torch==X.Y.Z" (or install torch
#     into .venv yourself before running this): an importable torch is never replaced.
#   - mup (the extra .[mup], model.parametrization=mup) is installed with --no-deps: its package metadata asks
#     for torchvision and seaborn, which it needs only for its own examples, and PyPI's torchvision would
#     replace a CPU torch by a CUDA build.
#   - PYTHON picks the interpreter (default: python3, 3.10 or newer).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.hookexp-setup"
want="$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
sorted() { tr ', ' '\n\n' | sed '/^$/d' | sort -u | paste -sd, -; }
hash="" have=""
[ -f "$stamp" ] && read -r hash have < "$stamp" || true
[ "$hash" = "$want" ] || have=""  # pyproject.toml changed: every extra is reinstalled when asked for
have="$(printf '%s' "$have" | sorted)"
need="$(printf '%s,%s' "$have" "${1:-}" | sorted)"
if [ "$hash" = "$want" ] && [ "$need" = "$have" ]; then
    exit 0
fi
extras="$(printf '%s' "$need" | tr ',' '\n' | sed '/^mup$/d' | paste -sd, -)"  # mup: below, without its deps
spec="$root${extras:+[$extras]}"
echo "hookexp: setting up $venv${need:+ with the extras $need} ..." >&2
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet "${HOOKEXP_TORCH:-torch==2.13.0}"
fi
"$venv/bin/python" -m pip install --quiet -e "$spec"
case ",$need," in *,mup,*) "$venv/bin/python" -m pip install --quiet --no-deps "mup>=1.0" ;; esac
echo "$want $need" > "$stamp"
echo "hookexp: set-up done." >&2
