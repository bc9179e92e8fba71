"""The policy-templates bench: ``python -m bench --templates [--quick]`` (issue 32).

What a policy template costs against the same budget set queue by queue,
measured in one run on a fresh database (an embedded PostgreSQL unless
``--database-url``) and one server with default settings:

1. **Claims** (``bench.py``): N queues (3,000; 60 with ``--quick``) of one
   endpoint under one template (``acct:*``: a DAY window limit and
   ``max_in_flight``), 10% of them window-exhausted, against N queues of
   another endpoint with the same limits set by ``SetPolicy`` on each, 10%
   exhausted too. K callers make single-todo ``ClaimNext`` calls (no queues
   named: the endpoint's eligible queues) for a fixed time and complete each
   claim: p50/p99 and PostgreSQL CPU per claim, rounds interleaved
   (templates then explicit, then explicit then templates, ...).
2. **Idle cost**: PostgreSQL CPU over an idle window with nothing set up,
   with the N template queues, and with the N explicit policies beside them.
3. **A template change**: ``SetPolicyTemplate`` raising the limit over the N
   queues, then lowering it back: each call's wall time, and the claim p99 of
   a third endpoint's callers during the call against a window before it (a
   raise re-checks no queue's gate one by one, a lowering every queue's).
4. **The board** (``board.py``), after the idle windows and before the
   claim rounds: a signed-in human fetches the front page and the
   template's page (unfiltered, over budget only, one account by prefix)
   over HTTP, each several times: median and max time, size, rows of
   queues, and the server's and PostgreSQL's CPU per page (target: each
   under 500 ms).

Results: ``bench/results/<date>-<commit>-templates.json`` and
``bench/results/latest-templates.md`` (``--quick``: ``bench/results/tmp/``).
The machine's other load counts in the CPU figures: the ratios within one
run are what counts.
"""

from __future__ import annotations

from bench.templates.run import run_templates

__all__ = ["run_templates"]
