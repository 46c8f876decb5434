"""``python -m hookexp.report DIR [DIR ...]``: the table and plot of a sweep, the same command as ``hookexp report``
(:mod:`hookexp.analysis.report`); this module only runs it."""

import sys

from hookexp.cli import subcommand

if __name__ == "__main__":
    sys.exit(subcommand("report", sys.argv[1:]))
