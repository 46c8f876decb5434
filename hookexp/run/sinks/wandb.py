"""``logger=wandb``: :class:`WandbSink`, one W&B run per job; ``wandb`` is imported only when it is used."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hookexp.config import LoggerConfig
from hookexp.run.sinks.base import STEP_KEY, Histograms, RunInfo

log = logging.getLogger("hookexp.sinks")


def wandb_mode(mode: str) -> str:
    """The W&B mode a run uses: ``WANDB_MODE`` in the environment wins over ``logger.mode``, as W&B users expect
    (CI switches W&B off with ``WANDB_MODE=disabled``); W&B's old names ``dryrun`` and ``run`` are offline and
    online. :func:`check_logger` has refused any other value."""
    env = os.environ.get("WANDB_MODE")
    return str(mode) if env is None else {"dryrun": "offline", "run": "online"}.get(env, env)


class WandbSink:
    """One W&B run per job (``logger=wandb``). ``mode=offline`` writes it under ``<run_dir>/wandb``; an unreachable
    server in ``online`` mode falls back to offline with one warning instead of killing training; ``disabled``
    (or ``WANDB_MODE=disabled``): this sink does nothing and W&B is not imported. ``logger``: the ``logger``
    config (None: its defaults); the W&B tags are ``tags`` and the names of the enabled hook specs.

    ``run.log`` costs milliseconds of Python for a log step with many keys, so it runs on one worker
    thread that consumes an ordered queue (while the training thread is inside torch's kernels,
    which release the GIL). ``finish`` drains the queue first; a failure in the worker is reported
    once as a warning and never stops training (the local files hold the same numbers). The queue is
    bounded (``QUEUE_SIZE`` log steps): if W&B falls behind, training waits rather than memory grows.
    A step's histograms wait for its scalars: they are one W&B history row, as in the local files' step.
    """

    QUEUE_SIZE = 32

    def __init__(self, run: RunInfo, logger: LoggerConfig | None = None):
        cfg = logger if logger is not None else LoggerConfig()
        mode, tags, quiet = cfg.mode, cfg.tags, cfg.quiet
        self.run: Any = None
        self._hists: tuple[int, dict[str, Any]] | None = None
        self._error: BaseException | None = None
        resolved = wandb_mode(mode)
        if resolved != mode:
            log.info("W&B mode %s, from WANDB_MODE in the environment (it wins over logger.mode=%s)", resolved, mode)
        if resolved == "disabled":
            return
        import wandb

        self._wandb = wandb
        run_dir = run.run_dir
        tags = [*tags, *(row["spec"] for row in run.hooks_table if row["enabled"])]
        kept = run.resume or {}
        # a resumed run keeps the name and group its first part was given (a multirun job's: its overrides and the
        # sweep), unless the config names others
        self.identity = {k: v for k, v in (("name", cfg.name if cfg.name is not None else kept.get("name")),
                                           ("group", cfg.group if cfg.group is not None else kept.get("group")))
                         if v is not None}
        kwargs = dict(project=cfg.project or "hookexp", entity=cfg.entity, group=self.identity.get("group"),
                      job_type=cfg.job_type, name=self.identity.get("name"), tags=tags, config=run.config,
                      dir=str(run_dir), reinit="finish_previous")
        if kept.get("id"):  # a resumed run continues its W&B run
            kwargs.update(id=kept["id"], resume="allow")
        timeout = float(cfg.init_timeout)
        if resolved == "online":
            base_url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
            if not _answers(base_url, timeout):  # never start an online run that would hang init and the exit
                log.warning("the W&B server %s did not answer within logger.init_timeout=%g s; logging offline under "
                            "%s/wandb instead. Upload later with `wandb sync`.", base_url, timeout, run_dir)
                resolved = "offline"
                # W&B's own telemetry exporter would wait on the same server at exit (~10 s with wandb 0.31)
                os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        # quiet: W&B's ~30 lines of history and summary at the end would bury hookexp's own summary line
        settings = wandb.Settings(init_timeout=timeout, quiet=bool(quiet))
        try:
            self.run = wandb.init(mode=resolved, settings=settings, **kwargs)
        except Exception as e:
            if resolved != "online":
                raise
            log.warning("W&B online init failed (%s: %s); logging offline under %s/wandb instead. Upload later with "
                        "`wandb sync`.", type(e).__name__, e, run_dir)
            self.run = wandb.init(mode="offline", settings=settings, **kwargs)
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        if run.hooks_table:
            columns = ["spec", "kind", "transform", "args", "enabled", "targets"]
            rows = [[r["spec"], r["kind"], r["transform"], json.dumps(r["args"]), r["enabled"],
                     ", ".join(r["targets"])] for r in run.hooks_table]
            self.run.log({"hooks/table": wandb.Table(columns=columns, data=rows)}, commit=False)
        # Bounded: when W&B falls behind, training waits for it instead of queueing rows without end.
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=self.QUEUE_SIZE)
        self._worker = threading.Thread(target=self._work, name="hookexp-wandb", daemon=True)
        self._worker.start()

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else str(self.run.id)

    def resume_state(self) -> dict[str, Any]:
        """The W&B run id, and the name and group it was given: a run resumed from this checkpoint continues this
        W&B run under them."""
        return {} if self.run is None else {"id": self.run_id, **self.identity}

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            if self._error is None:
                try:
                    job()
                except Exception as e:
                    self._error = e

    def _check(self) -> None:
        if self._error is not None and not getattr(self, "_warned", False):
            self._warned = True
            log.warning("W&B logging failed (%s: %s); the run continues and the local files (metrics.jsonl, "
                        "histograms.jsonl) hold every value.", type(self._error).__name__, self._error)

    def _send(self, row: dict[str, Any], hists: Mapping[str, tuple[Any, Any]]) -> None:
        self._queue.put(lambda: self.run.log({**row, **{k: self._histogram(*h) for k, h in hists.items()}}))
        self._check()

    def _send_histograms(self) -> None:
        """Histograms whose step logged no scalars: a row of their own."""
        if self._hists is not None:
            (step, hists), self._hists = self._hists, None
            self._send({STEP_KEY: step}, hists)

    def log_histograms(self, histograms: Histograms, step: int) -> None:
        if self.run is not None:
            self._send_histograms()
            self._hists = (step, dict(histograms))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self.run is None:
            return
        hists: dict[str, Any] = {}
        if self._hists is not None and self._hists[0] == step:
            (_, hists), self._hists = self._hists, None
        self._send_histograms()
        self._send({STEP_KEY: step, **metrics}, hists)

    def _histogram(self, counts: Any, edges: Any) -> Any:
        return self._wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))

    def spike(self, row: Mapping[str, Any]) -> None:
        """Nothing: ``spikes.jsonl`` holds the spikes."""

    def image(self, key: str, path: Path, step: int) -> None:
        if self.run is not None:
            self._send_histograms()
            self._queue.put(lambda: self.run.log({STEP_KEY: step, key: self._wandb.Image(str(path))}))

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        if self.run is None:
            return
        self._send_histograms()
        self._queue.put(None)
        self._worker.join()
        self._check()
        for k, v in summary.items():
            self.run.summary[k] = v
        self.run.finish(exit_code=1 if failed else 0)


def _answers(url: str, timeout: float) -> bool:
    """Whether an HTTP server answers at ``url`` within ``timeout`` seconds (any status counts)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # it answered, if only to refuse
    except (OSError, ValueError):
        return False
