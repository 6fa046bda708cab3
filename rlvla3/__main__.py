"""``python -m rlvla3 ...``: the ``rlvla3`` command, without its console script on PATH."""

from rlvla3.cli import main

main()
