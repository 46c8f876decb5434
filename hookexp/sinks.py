"""Moved to :mod:`hookexp.run.sinks`; this old import path keeps working."""

import sys

from hookexp.run import sinks

sys.modules[__name__] = sinks  # hookexp.sinks is hookexp.run.sinks: every name, one object
