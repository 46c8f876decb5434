"""``hookexp ablate hooks=[a,b,c] seed=0,1,2 [overrides]``: a leave-one-out ablation.

Runs one Hydra multirun over ``+ablate=none,a,b,c,all`` (all specs on, each one off, all off) times
the given sweeps (seeds), then prints the report table of ``hookexp report``. The same
study by hand:

    python -m hookexp -m hooks=[a,b,c] +ablate=none,a,b,c,all seed=0,1,2
    hookexp report multirun/<date>/<time>
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from hookexp.run import compose


def is_sweep(override: str) -> bool:
    """Whether an override sweeps (``seed=0,1,2``): a comma outside brackets in its value."""
    depth = 0
    for ch in override.partition("=")[2]:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            return True
    return False


def spec_names(overrides: list[str]) -> list[str]:
    """The hook specs the overrides select (``hooks=...``, ``experiment=...``); sweeps and Hydra's own
    settings are left out of this composition."""
    fixed = [o for o in overrides if not is_sweep(o) and not o.lstrip("+~").startswith("hydra")]
    return list(compose(*fixed).hooks)  # Hydra's errors (hooks=[a,typo]) as hookexp's ConfigError


def main(argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if not overrides or overrides[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    from hookexp.errors import HookexpError

    try:
        names = spec_names(overrides)
    except HookexpError as e:
        print(f"hookexp ablate: error: {e}", file=sys.stderr)
        return 2
    if not names:
        print("hookexp ablate: error: the selected hooks have no specs to ablate; select a hook set, e.g. "
              "hooks=[clamp_conv,zero_fc_bias].", file=sys.stderr)
        return 2
    if not any(o.startswith("hydra.sweep.dir=") for o in overrides):
        overrides.append(f"hydra.sweep.dir=multirun/ablate-{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    sweep_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweep.dir=")))
    levels = ",".join(["none", *names, "all"])
    command = [sys.executable, "-m", "hookexp", "-m", *overrides, f"+ablate={levels}"]
    print("hookexp ablate:", " ".join(command[1:]), file=sys.stderr, flush=True)
    status = subprocess.call(command)
    from hookexp.analysis.report import report

    try:
        markdown, _, _ = report([sweep_dir])
    except HookexpError as e:
        print(f"hookexp ablate: error: {e}", file=sys.stderr)
        return status or 2
    print(markdown)
    print(f"hookexp.ablate: wrote {sweep_dir / 'report.md'} and report.png (the jobs are in {sweep_dir})",
          file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
