"""What the benchmarks share: launching a run and reading it, provenance stamps, tables and JSON,
a rehearsal cluster. Imported as ``harness`` by the scripts in bench/ (run as ``python bench/x.py``,
which puts bench/ first on sys.path) and as ``bench.harness`` by the tests."""
