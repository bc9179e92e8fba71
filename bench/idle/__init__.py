"""The idle bench: ``python -m bench --idle [--quick]`` (issue 20).

What a fleet of idle, budgeted queues costs the database, however many of
them are full on in-flight slots, and how soon a settle on one of them rings
``SLOT_FREED``. One run:

1. a fresh database and one server process with default settings; 50
   endpoints with 100 queues each (5,000; ``--quick``: 10 of 30), each with a
   real policy set by ``SetPolicy`` (``max_in_flight`` 2 and a daily window
   of 10⁹ claims, never spent, so each has a window schedule) and 5 pending
   todos (bench SQL); every third queue (1,667) is then filled through the
   API as a worker would: ``ClaimNext`` of 2 with a 1 h lease, then one more
   ``ClaimNext``, refused (in-flight full);
2. once the server is quiet (no deferred gate due), measures for 30 s with
   no client traffic: PostgreSQL CPU (the cluster's processes, including
   children that exited, as % of one core), transactions, tuples written,
   ``queue_gates`` rows updated and WAL bytes per second, calls of the
   sweep and of the admission evaluation (``track_functions``), and the
   server processes' CPU; VACUUM ANALYZE, a checkpoint and 15 s without client traffic
   come first (statistics a busy backend could not flush arrive up to 10 s
   late);
3. the same with a second replica on the same database;
4. with 2,000 queues full and both replicas: one ``WatchReopen`` stream per
   endpoint on replica 1, then 100 settles (``Complete`` through replica 2,
   one every 100 ms, on distinct full queues): per settle, the time from
   the ``Complete`` response to its ``SLOT_FREED`` doorbell, and whether
   each rang exactly once and nothing else rang;
5. every claim released (no queue full): the idle measurement again, with
   2 replicas and then with 1.

Targets: idle PostgreSQL below 1% of a core with 1 and with 2 replicas;
``SLOT_FREED`` p99 ≤ 250 ms after a settle with 2,000 full queues, each
settle rung once. The machine's other load counts in the CPU figures
(nothing is subtracted; the load average is recorded).
"""

from __future__ import annotations

from bench.idle.run import run_idle

__all__ = ["run_idle"]
