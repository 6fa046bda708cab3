"""What the benchmarks share: launching a run and reading its summary, provenance stamps, tables
and the ``--json`` / ``--smoke`` flags, real rollout servers under measurement, echo servers and
clients, /proc figures, the table-top evaluation, a rehearsal cluster.

Imported as ``harness`` by the scripts in bench/ (``python bench/x.py`` puts the script's folder
first on the import path) and as ``bench.harness`` by the tests; inside, modules import each
other relatively, so both names work.
"""
