#!/usr/bin/env bash
# Quick start 1: `python -m hookexp` with the given Hydra overrides, on the embedded defaults
# (digits data from scikit-learn, W&B offline). Sets up .venv first when needed.
#   ./scripts/run.sh hooks=clamp_conv
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"  # the main job: torch and the base dependencies, no extra
exec "$root/.venv/bin/python" -m hookexp "$@"
