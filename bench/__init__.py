"""Switchboard benchmarks: claim throughput, admission cost and scale.

Run ``python -m bench`` (or ``scripts/bench``) from the repository root; see
docs/performance.md, ``bench/run.py`` (the command line), ``bench/harness.py``
(the run loop) and ``bench/scenarios/`` (one module per scenario family).
"""
