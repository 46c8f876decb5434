"""Moved to :mod:`hookexp.workloads.tasks`; this old import path keeps working."""

import sys

from hookexp.workloads import tasks

sys.modules[__name__] = tasks  # hookexp.tasks is hookexp.workloads.tasks: every name, one object
