"""Which way a metric should move, and targets on it: one rule for the run summary's ``*_best``, the report's
``--reach``, its plots' log axes, ``trainer.stop_when`` and the sweep objective (``optimized_metric``).

A metric whose name ends in loss, ppl, perplexity or mse falls as training succeeds; every other one rises.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hookexp.errors import ConfigError, did_you_mean

LOWER_IS_BETTER = ("loss", "ppl", "perplexity", "mse")


def lower_is_better(metric: str) -> bool:
    """Whether a metric falls as training succeeds: its name ends in loss, ppl, perplexity or mse."""
    return metric.lower().endswith(LOWER_IS_BETTER)


@dataclass(frozen=True)
class Reach:
    """A target: ``metric op value`` (``>=`` or ``<=``), e.g. ``val/acc>=0.95``."""

    metric: str
    op: str  # ">=" or "<="
    value: float

    @classmethod
    def parse(cls, text: str, key: str = "--reach") -> Reach:
        """``METRIC=VALUE`` (the direction from the metric's name) or ``METRIC>=VALUE`` / ``METRIC<=VALUE``."""
        found = re.fullmatch(r"\s*([^<>=\s]+)\s*(<=|>=|=)\s*(\S+)\s*", str(text))
        try:
            value = float(found.group(3)) if found else math.nan
        except ValueError:
            value = math.nan
        if not found or not math.isfinite(value):
            raise ConfigError(f"{text!r} is not a target. Write METRIC=VALUE (>= for metrics that grow, <= for "
                              "names ending in loss, ppl, perplexity or mse), or METRIC>=VALUE / METRIC<=VALUE to "
                              f"give the direction, e.g. {key}=val/acc=0.95 or {key}=val/loss<=0.1."
                              if key.startswith("trainer.") else
                              f"{text!r} is not a target. Write METRIC=VALUE (>= for metrics that grow, <= for "
                              "names ending in loss, ppl, perplexity or mse), or METRIC>=VALUE / METRIC<=VALUE to "
                              "give the direction, e.g. --reach val/acc=0.95 or --reach val/loss<=0.1.", key=key)
        metric, op = found.group(1), found.group(2)
        if op == "=":
            op = "<=" if lower_is_better(metric) else ">="
        return cls(metric, op, value)

    def holds(self, value: float) -> bool:
        return math.isfinite(value) and (value >= self.value if self.op == ">=" else value <= self.value)

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


def objective(name: str | None, logged: Sequence[str]) -> str:
    """The metric a sweep optimizes (config key ``optimized_metric``): ``name``, or when it is null ``val/acc`` if
    the task logs it, else ``val/loss``. ``logged``: the task's ``train/`` and ``val/`` metrics; a ``val/`` one may
    also be named as its summary's ``*_best``. Any other name is refused, with did-you-mean."""
    if name is None:
        return "val/acc" if "val/acc" in logged else "val/loss"
    known = [*logged, *(f"{m}_best" for m in logged if m.startswith("val/"))]
    if str(name) not in known:
        raise ConfigError(f"{name!r} is not a metric this task logs.{did_you_mean(str(name), known)} A sweep can "
                          f"optimize one of: {', '.join(known)}; or set it to null (val/acc when the task logs it, "
                          "else val/loss).", key="optimized_metric")
    return str(name)


def objective_value(metric: str, summary: Mapping[str, Any]) -> float | None:
    """What a job returns to the sweeper: ``metric``'s value in the run summary, negated when lower is better, so
    that a sweeper always maximizes; None when the summary has no number for it."""
    value = summary.get(metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return -float(value) if lower_is_better(metric) else float(value)
