"""Switchboard benchmarks: claim throughput, admission cost and scale.

Run ``python -m bench`` (or ``scripts/bench``) from the repository root; see
docs/performance.md and ``bench/run.py``.
"""
