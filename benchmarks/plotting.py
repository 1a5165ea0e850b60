"""matplotlib for the benchmarks' plots: headless (Agg), and optional, since a benchmark's CSV
stands without its plot."""

from __future__ import annotations


def pyplot(quiet: bool = False):
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (saying
    so unless `quiet`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not quiet:
            print("matplotlib missing: no plot")
        return None
    return plt
