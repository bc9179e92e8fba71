"""The server's send limit covers the largest answer built from the field limits,
and the clients receive at least that much."""

from __future__ import annotations

import math
import re
import uuid
from pathlib import Path

import pytest
from google.protobuf import timestamp_pb2
from google.protobuf.message import Message
from switchboard_dispatch import connect
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.dispatch import DispatchSettings
from switchboard_server.servicers import sizes
from switchboard_server.servicers.validate import (
    MAX_BATCH,
    MAX_CLAIMANT,
    MAX_CONTENT_TYPE,
    MAX_DEDUP_PART,
    MAX_ERROR,
    MAX_PAGE_SIZE,
    MAX_PAYLOAD_BYTES,
    MAX_RESULT_BYTES,
    MAX_TODO_ID,
    MAX_ZONE,
)

ROOT = Path(__file__).resolve().parents[2]
#: A character of 4 bytes in UTF-8: the most any one character takes.
WIDE = "\U0001f600"
#: Larger than any varint an int32 field holds in practice (10 bytes).
INT = -1
WHEN = timestamp_pb2.Timestamp(seconds=253_402_300_799, nanos=999_999_999)
BATCH_BYTES = DispatchSettings().batch_bytes


def queue() -> queue_pb2.QueueRef:
    return queue_pb2.QueueRef(endpoint_id=str(uuid.uuid4()), name="q" * 64)


def largest_todo(*, payload: int = MAX_PAYLOAD_BYTES, error: int = MAX_ERROR) -> todo_pb2.Todo:
    """A todo with every field at its limit (its payload and error as given)."""
    return todo_pb2.Todo(
        id=str(MAX_TODO_ID),
        queue=queue(),
        state=todo_pb2.TODO_STATE_CANCELLED,
        payload=b"p" * payload,
        content_type=WIDE * MAX_CONTENT_TYPE,
        attempt=INT,
        max_attempts=INT,
        next_retry_at=WHEN,
        lease_expires_at=WHEN,
        claimant=WIDE * MAX_CLAIMANT,
        dedup=todo_pb2.DedupKey(
            webhook_id=WIDE * MAX_DEDUP_PART, delivery_id=WIDE * MAX_DEDUP_PART
        ),
        last_error=WIDE * error,
        created_at=WHEN,
        updated_at=WHEN,
        finished_at=WHEN,
        admission=admission_pb2.AdmissionStatus(
            state=admission_pb2.ADMISSION_STATE_DEFERRED,
            reason=admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE,
            next_eligible_at=WHEN,
            exact=True,
        ),
        idempotency_key=WIDE * MAX_DEDUP_PART,
        traceparent="0" * sizes.TRACEPARENT_CHARS,
        schedule_id=str(MAX_TODO_ID),
        schedule_slot=WHEN,
        priority=INT,
    )


def with_result(todo: todo_pb2.Todo) -> todo_pb2.Todo:
    todo.result.data = b"r" * MAX_RESULT_BYTES
    todo.result.content_type = WIDE * MAX_CONTENT_TYPE
    return todo


def lease() -> todo_pb2.Lease:
    return todo_pb2.Lease(lease_id=str(uuid.uuid4()), expires_at=WHEN)


def headroom() -> admission_pb2.Headroom:
    return admission_pb2.Headroom(
        window_used=INT,
        window_limit=INT,
        window_remaining=INT,
        resets_at=WHEN,
        in_flight_used=INT,
        in_flight_limit=INT,
    )


def policy() -> admission_pb2.AdmissionPolicy:
    return admission_pb2.AdmissionPolicy(
        queue=queue(),
        max_in_flight=INT,
        max_claims_per_window=INT,
        window=admission_pb2.Window(
            period=admission_pb2.WINDOW_PERIOD_WEEK,
            time_zone=WIDE * MAX_ZONE,
            start="00:00",
            weekday=admission_pb2.WEEKDAY_SUNDAY,
        ),
        updated_at=WHEN,
    )


def deferred() -> list[admission_pb2.DeferredQueue]:
    return [
        admission_pb2.DeferredQueue(
            queue=queue(),
            reason=admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE,
            pending=INT,
            next_eligible_at=WHEN,
            exact=True,
        )
    ] * sizes.MAX_DEFERRED_REPORTED


def without_payload() -> todo_pb2.Todo:
    todo = largest_todo()
    todo.ClearField("payload")
    return todo


def claim_batch(payload: int, error: int) -> dispatch_pb2.ClaimNextResponse:
    """The longest batch sb_lock_pending takes of todos this large: each counts
    its payload and error bytes plus 1 KiB, and the batch stops before passing
    batch_bytes (at least one is always taken)."""
    size = payload + len((WIDE * error).encode()) + 1024
    count = max(1, min(MAX_BATCH, BATCH_BYTES // size))
    item = dispatch_pb2.ClaimedTodo(todo=largest_todo(payload=payload, error=error), lease=lease())
    return dispatch_pb2.ClaimNextResponse(
        deferred=deferred(), headroom=headroom(), policy=policy(), claimed=[item] * count
    )


ANSWERS: list[tuple[str, Message]] = [
    (
        "GetTodo",
        dispatch_pb2.GetTodoResponse(
            todo=with_result(largest_todo()),
            attempts=[
                todo_pb2.Attempt(
                    number=INT,
                    claimed_at=WHEN,
                    claimant=WIDE * MAX_CLAIMANT,
                    outcome=todo_pb2.ATTEMPT_OUTCOME_CANCELLED,
                    finished_at=WHEN,
                    error=WIDE * MAX_ERROR,
                )
            ]
            * sizes.MAX_ATTEMPTS_LISTED,
            attempts_left_out=INT,
        ),
    ),
    (
        "ListTodos",
        dispatch_pb2.ListTodosResponse(
            todos=[without_payload()] * MAX_PAGE_SIZE, next_page_token="t" * 64
        ),
    ),
    (
        "IngestTodos",
        dispatch_pb2.IngestTodosResponse(
            results=[dispatch_pb2.IngestResult(todo=without_payload(), deduplicated=True)]
            * MAX_BATCH
        ),
    ),
    ("Ingest", dispatch_pb2.IngestResponse(todo=largest_todo(), deduplicated=True)),
    (
        "Claim",
        dispatch_pb2.ClaimResponse(
            todo=largest_todo(), lease=lease(), headroom=headroom(), policy=policy()
        ),
    ),
    (
        "ClaimNext",
        dispatch_pb2.ClaimNextResponse(
            todo=largest_todo(),
            lease=lease(),
            empty=True,
            deferred=deferred(),
            headroom=headroom(),
            policy=policy(),
        ),
    ),
    ("ClaimNext", claim_batch(0, 0)),  # 500 todos, all but payload and error at the limit
    ("ClaimNext", claim_batch(0, MAX_ERROR)),
    # 500 todos that use up the batch's budget: the largest batch.
    ("ClaimNext", claim_batch((BATCH_BYTES - MAX_BATCH * 1024) // MAX_BATCH, 0)),
    ("ClaimNext", claim_batch(MAX_PAYLOAD_BYTES // 2, MAX_ERROR)),
    ("ClaimNext", claim_batch(MAX_PAYLOAD_BYTES, MAX_ERROR)),  # one: it is always taken
    ("Complete", dispatch_pb2.CompleteResponse(todo=largest_todo())),
    ("CancelTodo", dispatch_pb2.CancelTodoResponse(todo=largest_todo())),
    (
        "WatchReopen",
        dispatch_pb2.WatchReopenResponse(
            doorbell=dispatch_pb2.Doorbell(
                queue=queue(),
                cause=dispatch_pb2.DOORBELL_CAUSE_POLICY_CHANGED,
                pending=INT,
                at=WHEN,
            )
        ),
    ),
]


@pytest.mark.parametrize(("rpc", "answer"), ANSWERS, ids=[a[0] for a in ANSWERS])
def test_the_largest_answer_fits_its_derived_bound_and_the_send_limit(
    rpc: str, answer: Message
) -> None:
    bound = sizes.answer_bytes()[rpc]
    assert answer.ByteSize() <= bound <= sizes.MAX_ANSWER_BYTES


def test_the_bounds_are_close_to_the_largest_answers() -> None:
    """A bound far above what it bounds would only hide a wrong derivation."""
    built: dict[str, int] = {}
    for rpc, answer in ANSWERS:
        built[rpc] = max(built.get(rpc, 0), answer.ByteSize())
    for rpc, size in built.items():
        assert sizes.answer_bytes()[rpc] < size * 1.1 + 4096, rpc


def test_a_field_without_a_bound_is_named() -> None:
    with pytest.raises(KeyError, match="TodoAuditEntry"):
        sizes.largest(dispatch_pb2.TodoAuditEntry.DESCRIPTOR)


def test_the_send_limit_covers_the_largest_todo_the_old_one_did_not() -> None:
    largest = dispatch_pb2.GetTodoResponse(todo=with_result(largest_todo())).ByteSize()
    assert largest > MAX_PAYLOAD_BYTES + 64 * 1024  # the former limit
    assert largest <= sizes.MAX_ANSWER_BYTES


def test_both_clients_receive_the_largest_answer() -> None:
    assert sizes.MAX_ANSWER_BYTES <= connect.MAX_RECEIVE_BYTES
    source = (ROOT / "clients/typescript/src/connection.ts").read_text()
    (expression,) = re.findall(r"export const MAX_RECEIVE_BYTES = ([0-9 *]+);", source)
    numbers = [int(n) for n in expression.split("*")]
    product = 1
    for n in numbers:
        product *= n
    assert product == connect.MAX_RECEIVE_BYTES
    assert "readMaxBytes: MAX_RECEIVE_BYTES" in source


def test_pages_of_schedules_are_cut_by_bytes_within_the_send_limit() -> None:
    from switchboard_dispatch.v1 import schedule_pb2

    def schedule(n: int) -> schedule_pb2.Schedule:
        return schedule_pb2.Schedule(
            id=str(n), template=schedule_pb2.TodoTemplate(payload=b"p" * MAX_PAYLOAD_BYTES)
        )

    entry = schedule_pb2.ScheduleAuditEntry(before=schedule(1), after=schedule(1))
    assert entry.ByteSize() < sizes.PAGE_BYTES  # every item fits a page
    assert sizes.PAGE_BYTES + 1024 <= sizes.MAX_ANSWER_BYTES  # every page fits the limit
    page = sizes.fill_page(range(20), schedule)
    assert [s.id for s in page] == [str(n) for n in range(7)]
    assert sum(s.ByteSize() for s in page) <= sizes.PAGE_BYTES
    assert [s.id for s in sizes.fill_page([0], schedule, budget=10)] == ["0"]  # always one


def test_a_page_read_one_item_beyond_its_size_names_the_next_page() -> None:
    from switchboard_dispatch.v1 import schedule_pb2
    from switchboard_server.servicers.validate import page_token_after

    def schedule(n: int) -> schedule_pb2.Schedule:
        return schedule_pb2.Schedule(id=str(n))

    def ids(page: list[schedule_pb2.Schedule]) -> list[str]:
        return [s.id for s in page]

    # Read page_size + 1: the extra one only tells that another page follows.
    page, token = sizes.answer_page([1, 2, 3], 2, schedule, int, budget=None)
    assert (ids(page), token) == (["1", "2"], page_token_after(2))
    assert sizes.answer_page([1, 2], 2, schedule, int, budget=None)[1] == ""
    assert sizes.answer_page([], 2, schedule, int) == ([], "")
    # Cut short by bytes: the next page goes on after the last item kept.
    page, token = sizes.answer_page([1, 2, 3], 2, schedule, int, budget=1)
    assert (ids(page), token) == (["1"], page_token_after(1))


def test_both_clients_send_within_the_request_limit() -> None:
    from switchboard_server.servicers.grpc_server import MAX_REQUEST_BYTES

    assert connect.MAX_SEND_BYTES == MAX_REQUEST_BYTES
    source = (ROOT / "clients/typescript/src/connection.ts").read_text()
    (expression,) = re.findall(r"export const MAX_SEND_BYTES = ([0-9 *+]+);", source)
    terms = [math.prod(int(n) for n in term.split("*")) for term in expression.split("+")]
    assert sum(terms) == MAX_REQUEST_BYTES


def test_settle_batches_are_cut_by_encoded_size() -> None:
    from switchboard_dispatch.worker._common import MAX_BATCH, MAX_BATCH_BYTES
    from switchboard_dispatch.worker.held import Held
    from switchboard_dispatch.worker.settler import by_size

    def held(n: int, error: str) -> Held:
        h = Held(todo_id=str(n), lease_id=str(uuid.uuid4()), expires=0.0, extended_at=0.0)
        h.settlement = dispatch_pb2.Settlement(todo_id=h.todo_id, lease_id=h.lease_id)
        h.settlement.fail.error = error
        return h

    # The largest failures (every character 4 bytes of UTF-8), a full batch of them.
    batch = [held(n, "\U0001f600" * MAX_ERROR) for n in range(MAX_BATCH)]
    runs = by_size(batch)
    assert [h for run in runs for h in run] == batch  # in order, none left out

    def request_bytes(run: list[Held]) -> int:
        settlements = [h.settlement for h in run if h.settlement is not None]
        return dispatch_pb2.SettleTodosRequest(settlements=settlements).ByteSize()

    assert len(runs) > 1
    for run, after in zip(runs, [*runs[1:], []], strict=True):
        assert request_bytes(run) <= MAX_BATCH_BYTES
        if after:  # each call is as full as the next settlement lets it be
            assert request_bytes([*run, after[0]]) > MAX_BATCH_BYTES
    small = [held(n, "") for n in range(MAX_BATCH)]
    assert by_size(small) == [small]
    # One that alone is over the budget gets a call of its own; the rest still fit.
    big, *rest = [held(n, "x" * (400 if n == 0 else 100)) for n in range(5)]
    assert by_size([big, *rest], budget=300) == [[big], rest[:2], rest[2:]]
