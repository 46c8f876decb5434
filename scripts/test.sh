#!/usr/bin/env bash
# Quick start 2: lint and run the whole test suite. Sets up .venv first when needed.
#   ./scripts/test.sh            # everything
#   ./scripts/test.sh -k engine  # extra arguments go to pytest
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" dev,sweeps,hf,lightning,mup,tensorboard,docs  # every extra the tests use
cd "$root"
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
