"""Helpers for admission tests: policies, ingesting, draining."""

from __future__ import annotations

from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2

from tests.support.client import Client

#: A test-only deferred constraint trigger that records, at each claim's
#: COMMIT (while the claim still holds its queue's policy lock, with fresh
#: snapshots), the queue's in-flight count, the current window's units and the
#: limits in force, in ``claim_observations``.
CLAIM_OBSERVER = """
CREATE TABLE claim_observations (
    todo_id bigint, attempt integer, claimed_at timestamptz,
    in_flight bigint, max_in_flight integer, units integer, window_limit integer
);
CREATE FUNCTION observe_claim() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_policy admission_policies;
BEGIN
    SELECT p.* INTO v_policy FROM admission_policies p
      JOIN queues q ON q.policy_id = p.id WHERE q.id = NEW.queue_id AND p.active;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO claim_observations
    SELECT NEW.id, NEW.attempt, NEW.claimed_at,
           (SELECT count(*) FROM todos t WHERE t.queue_id = NEW.queue_id AND t.state = 'claimed'),
           v_policy.max_in_flight,
           -- The latest window charged is the current one: none lies ahead.
           (SELECT c.units FROM window_counters c
             WHERE c.policy_id = v_policy.id AND c.window_start <= NEW.claimed_at
             ORDER BY c.window_start DESC LIMIT 1),
           v_policy.max_claims_per_window;
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER observe_claim AFTER UPDATE OF attempt ON todos
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.state = 'claimed' AND NEW.attempt > OLD.attempt)
    EXECUTE FUNCTION observe_claim();
"""


def window(
    period: admission_pb2.WindowPeriod.ValueType = admission_pb2.WINDOW_PERIOD_DAY,
    zone: str = "UTC",
    start: str = "00:00",
    weekday: admission_pb2.Weekday.ValueType = admission_pb2.WEEKDAY_UNSPECIFIED,
) -> admission_pb2.Window:
    """A window message."""
    return admission_pb2.Window(period=period, time_zone=zone, start=start, weekday=weekday)


async def set_policy(
    client: Client,
    metadata: tuple[tuple[str, str], ...],
    queue: str,
    *,
    endpoint_id: str = "",
    max_in_flight: int | None = None,
    max_claims_per_window: int | None = None,
    win: admission_pb2.Window | None = None,
) -> admission_pb2.AdmissionPolicy:
    """Sets a queue's policy (a DAY window in UTC by default when a window limit is given)."""
    policy = admission_pb2.AdmissionPolicy(
        queue=queue_pb2.QueueRef(endpoint_id=endpoint_id, name=queue)
    )
    if max_in_flight is not None:
        policy.max_in_flight = max_in_flight
    if max_claims_per_window is not None:
        policy.max_claims_per_window = max_claims_per_window
        policy.window.CopyFrom(win or window())
    resp = await client.admission.SetPolicy(
        admission_pb2.SetPolicyRequest(policy=policy), metadata=metadata
    )
    return resp.policy


async def ingest(
    client: Client,
    metadata: tuple[tuple[str, str], ...],
    queue: str,
    n: int = 1,
    *,
    max_attempts: int | None = None,
) -> list[str]:
    """Ingests ``n`` todos into a queue of the caller's endpoint; returns their ids."""
    ids = []
    for i in range(n):
        request = dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(name=queue), payload=str(i).encode()
        )
        if max_attempts is not None:
            request.max_attempts = max_attempts
        resp = await client.dispatch.Ingest(request, metadata=metadata)
        ids.append(resp.todo.id)
    return ids


async def ingest_in_batches(
    client: Client,
    metadata: tuple[tuple[str, str], ...],
    queue: str,
    n: int,
    *,
    batch: int = 500,
    max_attempts: int | None = None,
) -> None:
    """Ingests ``n`` todos (payload ``x``) into a queue of the caller's
    endpoint, ``batch`` to an ``IngestTodos`` call."""
    for start in range(0, n, batch):
        items = [
            dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name=queue), payload=b"x")
            for _ in range(min(batch, n - start))
        ]
        if max_attempts is not None:
            for item in items:
                item.max_attempts = max_attempts
        await client.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(todos=items), metadata=metadata
        )
