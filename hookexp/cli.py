"""``python -m hookexp`` / ``hookexp``: the Hydra entry point.

Hydra composes ``conf/`` (shipped inside the package as ``hookexp.conf``) with the command line; this
module turns the composed config into a run. A mistake hookexp detects (a bad hook spec, a bad
argument) is printed as one paragraph and the process exits with status 2 before training; in a
multirun the job is marked failed and the other jobs go on.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hookexp.config import EXTRA_KEYS, HookexpConfig
from hookexp.errors import ConfigError, HookexpError, did_you_mean

log = logging.getLogger("hookexp")


def check_top_level(cfg: DictConfig) -> None:
    """Keys added with ``+key=value`` must be ones hookexp reads; a typo is an error, not ignored."""
    known = set(HookexpConfig.__dataclass_fields__) | set(EXTRA_KEYS)
    for key in cfg:
        if key not in known:
            extras = ", ".join(f"+{k}=... ({v})" for k, v in EXTRA_KEYS.items())
            raise ConfigError(f"unknown top-level key.{did_you_mean(str(key), known)} Keys you may add: {extras}.",
                              key=str(key))


def run(cfg: DictConfig) -> Any:
    """Run (or dry-run) one job; returns the optimised metric (val/acc) for sweepers."""
    from hookexp.train import dry_run, train  # torch is imported only once the config composed

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    check_top_level(cfg)
    if cfg.get("dry_run"):
        return dry_run(cfg, run_dir)
    summary = train(cfg, run_dir)
    log.info("finished: %s", ", ".join(f"{k}={v:.4f}" for k, v in summary.items()
                                        if k.startswith(("train/", "val/")) and isinstance(v, float)))
    return summary.get("val/acc")


@hydra.main(version_base="1.3", config_path="pkg://hookexp.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> Any:
    try:
        return run(cfg)
    except HookexpError as e:
        if HydraConfig.get().mode == RunMode.RUN:
            print(f"\nhookexp: error: {e}", file=sys.stderr)
            sys.exit(2)
        raise


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
