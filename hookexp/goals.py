"""Which way a metric should move, and targets on it: one rule for the run summary's ``*_best``, the report's
``--reach``, its plots' log axes and ``trainer.stop_when``.

A metric whose name ends in loss, ppl, perplexity or mse falls as training succeeds; every other one rises.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hookexp.errors import ConfigError

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
