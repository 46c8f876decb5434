"""Moved to :mod:`hookexp.workloads.models`; this old import path keeps working."""

import sys

from hookexp.workloads import models

sys.modules[__name__] = models  # hookexp.models is hookexp.workloads.models: every name, one object
