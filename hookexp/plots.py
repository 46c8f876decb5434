"""Moved to :mod:`hookexp.analysis.plots`; this old import path keeps working."""

import sys

from hookexp.analysis import plots

sys.modules[__name__] = plots  # hookexp.plots is hookexp.analysis.plots: every name, one object
