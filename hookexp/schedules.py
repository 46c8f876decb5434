"""Moved to :mod:`hookexp.workloads.schedules`; this old import path keeps working."""

import sys

from hookexp.workloads import schedules

sys.modules[__name__] = schedules  # hookexp.schedules is hookexp.workloads.schedules: every name, one object
