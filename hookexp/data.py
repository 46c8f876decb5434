"""Moved to :mod:`hookexp.workloads.data`; this old import path keeps working."""

import sys

from hookexp.workloads import data

sys.modules[__name__] = data  # hookexp.data is hookexp.workloads.data: every name, one object
