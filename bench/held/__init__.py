"""The held-claims bench: ``python -m bench --held [--quick]`` (issue 30).

What ``ClaimNext`` with a ``wait`` costs and gives, measured in one run on
a fresh database (an embedded PostgreSQL with pg_stat_statements preloaded
when the bench extra's contrib modules are installed) and server processes
with default settings:

1. **Idle cost** (``cost.py``): 1,000 callers held in ``ClaimNext(wait=30 s)``
   on idle queues, all on one endpoint (4 queues) and then spread over 10
   endpoints (40 queues), against no callers before and after: PostgreSQL
   CPU, transactions/s, top-level statements/s, claim transactions, the
   server's CPU and RSS over a 15 s window in which no call is issued or
   answered (11 s after the last is held: the entry claims' statistics
   arrive up to 10 s late). The entry claims (each call's first try) are measured apart:
   they are what re-issuing every call every 30 s costs.
2. **Latency** (``latency.py``): ingest → claimed p50/p99 for a held caller,
   a worker woken by ``WatchReopen`` (a ``ClaimNext`` on each doorbell) and a
   1-second polling loop, 200 samples each, interleaved, at random gaps.
3. **The herd** (``herd.py``): one todo arriving for 1,000 held callers,
   with 1 and with 2 replicas: the claim transactions each replica ran (its
   ``/metrics``) and the claim statements the database ran.

PostgreSQL's idle CPU is compared without the autovacuum workers that start
or end in a window (listed; ``cost.py`` says why), and
``python -m bench.held.idle_rounds`` repeats the idle measurements in ABBA
rounds. The drain scenarios with the worker helpers on the held claim are
``python -m bench.helper_drain`` (``bench/helper_drain.py``). Results:
``bench/results/<date>-<commit>-held.json``, ``bench/results/latest-held.md``
and the table in ``docs/performance.md``. The machine's other load counts in
the CPU figures (nothing is subtracted; the load average is recorded): the
ratios within one run are what counts.
"""

from __future__ import annotations

from bench.held.run import run_held

__all__ = ["run_held"]
