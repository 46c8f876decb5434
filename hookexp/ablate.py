"""Moved to :mod:`hookexp.analysis.ablate`; this old import path keeps working."""

import sys

from hookexp.analysis import ablate

if __name__ == "__main__":  # python -m hookexp.ablate
    sys.exit(ablate.main())
else:
    sys.modules[__name__] = ablate  # hookexp.ablate is hookexp.analysis.ablate: every name, one object
