"""Moved to :mod:`hookexp.analysis.report`; this old import path keeps working."""

import sys

from hookexp.analysis import report

if __name__ == "__main__":  # python -m hookexp.report
    report.main()
else:
    sys.modules[__name__] = report  # hookexp.report is hookexp.analysis.report: every name, one object
