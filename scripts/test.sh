#!/usr/bin/env bash
# Quick start 2: lint and run the whole test suite. Sets up .venv first when needed.
#   ./scripts/test.sh            # everything
#   ./scripts/test.sh -k engine  # extra arguments go to pytest
# pytest-xdist runs the tests in one worker per core (at most 8; HOOKEXP_TEST_WORKERS=N picks, 0: in this process),
# each test file in one worker (--dist loadfile: a module's fixtures are built once). Most of the suite's time is
# child processes (python -m hookexp, torchrun) that use one core each: two workers halve it on two cores.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" dev,sweeps,hf,lightning,mup,tensorboard,docs  # every extra the tests use
cd "$root"
.venv/bin/ruff check .
cores="$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
workers="${HOOKEXP_TEST_WORKERS:-$(( cores < 8 ? cores : 8 ))}"
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
