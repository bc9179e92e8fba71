"""Switchboard benchmarks: claim throughput, admission cost and scale.

Run ``python -m bench`` (or ``scripts/bench``) from the repository root; see
the README's Performance section and ``bench/run.py``.
"""
