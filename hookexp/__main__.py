"""``python -m hookexp``: see :mod:`hookexp.cli`."""

from hookexp.cli import main

main()
