"""Watching a run: the live terminal view, rates over a window, the Prometheus exporter."""
