"""Domain records to proto messages."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf import timestamp_pb2
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2, todo_pb2

from switchboard_server.dispatch import Action, refusal_message
from switchboard_server.doorbells import Doorbell
from switchboard_server.model import (
    Attempt,
    AttemptOutcome,
    AuditEntry,
    Credential,
    Endpoint,
    Grant,
    Human,
    ItemOutcome,
    Lease,
    Owner,
    PrincipalKind,
    Revision,
    SettledState,
    Todo,
    TodoResult,
    TodoSelection,
    TodoState,
)
from switchboard_server.policies import (
    AdmissionStatus,
    Deferral,
    DeferralReason,
    Headroom,
    Policy,
)
from switchboard_server.windows import Period

T = TypeVar("T")
#: A proto message.
M = TypeVar("M")
E = TypeVar("E", bound=enum.Enum)
V = TypeVar("V")


def by_name(domain: type[E], value: Callable[[str], V], prefix: str) -> dict[E, V]:
    """Each member of a domain enum to the wire enum's value named ``prefix``
    and the member's name (``TodoState.DONE``: ``TODO_STATE_DONE``); a member
    the wire does not have fails at import."""
    return {member: value(prefix + member.name) for member in domain}


TODO_STATE_TO_PROTO = by_name(TodoState, todo_pb2.TodoState.Value, "TODO_STATE_")
TODO_STATE_FROM_PROTO = {v: k for k, v in TODO_STATE_TO_PROTO.items()}

_OUTCOME = by_name(AttemptOutcome, todo_pb2.AttemptOutcome.Value, "ATTEMPT_OUTCOME_")

GRANT_TO_PROTO = by_name(Grant, admin_pb2.Grant.Value, "GRANT_")
GRANT_FROM_PROTO = {v: k for k, v in GRANT_TO_PROTO.items()}

KIND_TO_PROTO = by_name(PrincipalKind, admin_pb2.PrincipalKind.Value, "PRINCIPAL_KIND_")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    """A Timestamp for an aware datetime (a naive one is taken as UTC); ``None``
    stays unset. Computed from the difference to the epoch: several times
    cheaper than ``FromDatetime``, which every todo of a batch pays five times."""
    if value is None:
        return None
    if value.tzinfo is None:
        ts = timestamp_pb2.Timestamp()
        ts.FromDatetime(value)
        return ts
    delta = value - _EPOCH
    return timestamp_pb2.Timestamp(
        seconds=delta.days * 86400 + delta.seconds, nanos=delta.microseconds * 1000
    )


REASON_TO_PROTO = by_name(DeferralReason, admission_pb2.DeferralReason.Value, "DEFERRAL_REASON_")

PERIOD_TO_PROTO = by_name(Period, admission_pb2.WindowPeriod.Value, "WINDOW_PERIOD_")
PERIOD_FROM_PROTO = {v: k for k, v in PERIOD_TO_PROTO.items()}


def queue_ref(endpoint_id: uuid.UUID, name: str) -> queue_pb2.QueueRef:
    """The wire form of an endpoint queue."""
    return queue_pb2.QueueRef(endpoint_id=str(endpoint_id), name=name)


def policy(value: Policy) -> admission_pb2.AdmissionPolicy:
    """The wire form of an admission policy."""
    limits = value.limits
    msg = admission_pb2.AdmissionPolicy(
        queue=queue_ref(value.endpoint_id, value.queue), updated_at=timestamp(value.updated_at)
    )
    if limits.max_in_flight is not None:
        msg.max_in_flight = limits.max_in_flight
    if limits.max_claims_per_window is not None:
        msg.max_claims_per_window = limits.max_claims_per_window
    if limits.window is not None:
        msg.window.period = PERIOD_TO_PROTO[limits.window.period]
        msg.window.time_zone = limits.window.zone
        msg.window.start = limits.window.start.strftime("%H:%M")
        if limits.window.weekday is not None:
            msg.window.weekday = limits.window.weekday  # type: ignore[assignment]
    return msg


def headroom(value: Headroom) -> admission_pb2.Headroom:
    """The wire form of the budget left after a claim."""
    msg = admission_pb2.Headroom(resets_at=timestamp(value.resets_at))
    if value.window_limit is not None and value.window_used is not None:
        msg.window_used = value.window_used
        msg.window_limit = value.window_limit
        msg.window_remaining = max(value.window_limit - value.window_used, 0)
    if value.in_flight_limit is not None and value.in_flight_used is not None:
        msg.in_flight_used = value.in_flight_used
        msg.in_flight_limit = value.in_flight_limit
    return msg


def claim_headroom(
    msg: dispatch_pb2.ClaimResponse | dispatch_pb2.ClaimNextResponse, value: Headroom | None
) -> None:
    """Sets a claim's answer's headroom and the policy it is of (neither when
    the queue has no policy)."""
    if value is not None:
        msg.headroom.CopyFrom(headroom(value))
        msg.policy.CopyFrom(policy(value.policy))


def deferred_queue(value: Deferral) -> admission_pb2.DeferredQueue:
    """The wire form of a deferred queue in a ClaimNext answer."""
    return admission_pb2.DeferredQueue(
        queue=queue_ref(value.endpoint_id, value.queue),
        reason=REASON_TO_PROTO[value.reason],
        pending=value.pending,
        next_eligible_at=timestamp(value.next_eligible_at),
        exact=value.exact,
    )


def deferral_detail(value: Deferral) -> admission_pb2.DeferralDetail:
    """The typed detail of a deferred Claim."""
    return admission_pb2.DeferralDetail(
        queue=queue_ref(value.endpoint_id, value.queue),
        reason=REASON_TO_PROTO[value.reason],
        next_eligible_at=timestamp(value.next_eligible_at),
        exact=value.exact,
        pending=value.pending,
    )


def admission_status(value: AdmissionStatus) -> admission_pb2.AdmissionStatus:
    """The wire form of a pending todo's derived admission."""
    if not value.deferred:
        return admission_pb2.AdmissionStatus(state=admission_pb2.ADMISSION_STATE_ADMITTED)
    assert value.reason is not None
    return admission_pb2.AdmissionStatus(
        state=admission_pb2.ADMISSION_STATE_DEFERRED,
        reason=REASON_TO_PROTO[value.reason],
        next_eligible_at=timestamp(value.next_eligible_at),
        exact=value.exact,
    )


def audit_entry(make: Callable[..., M], value: AuditEntry[Any, Any], **fields: Any) -> M:
    """The wire form of an audit entry of any kind: ``make`` (the kind's
    message) of the entry's id, who made the change and when, and ``fields``,
    what the kind adds (its subject, action and change)."""
    return make(
        id=str(value.id),
        actor_human_id=str(value.actor_human_id or ""),
        actor_endpoint_id=str(value.actor_endpoint_id or ""),
        actor_credential_id=str(value.actor_credential_id or ""),
        at=timestamp(value.at),
        **fields,
    )


def revision(value: Revision[T], build: Callable[[T], M]) -> dict[str, M | None]:
    """The ``before`` and ``after`` fields of an audited change, each ``build``
    (unset where there is none)."""
    return {
        "before": build(value.before) if value.before is not None else None,
        "after": build(value.after) if value.after is not None else None,
    }


def policy_audit_entry(
    value: AuditEntry[str, Revision[Policy]],
) -> admission_pb2.PolicyAuditEntry:
    """The wire form of one audited policy change."""
    return audit_entry(
        admission_pb2.PolicyAuditEntry,
        value,
        queue=queue_ref(value.endpoint_id, value.subject),
        action=admission_pb2.POLICY_ACTION_SET
        if value.action == "set"
        else admission_pb2.POLICY_ACTION_CLEAR,
        **revision(value.change, policy),
    )


_CAUSE_TO_PROTO = {
    "created": dispatch_pb2.DOORBELL_CAUSE_CREATED,
    "attached": dispatch_pb2.DOORBELL_CAUSE_ATTACHED,
    "heartbeat": dispatch_pb2.DOORBELL_CAUSE_HEARTBEAT,
    "window_boundary": dispatch_pb2.DOORBELL_CAUSE_WINDOW_BOUNDARY,
    "slot_freed": dispatch_pb2.DOORBELL_CAUSE_SLOT_FREED,
    "policy_changed": dispatch_pb2.DOORBELL_CAUSE_POLICY_CHANGED,
}


def doorbell(value: Doorbell) -> dispatch_pb2.Doorbell:
    """The wire form of a doorbell."""
    return dispatch_pb2.Doorbell(
        queue=queue_ref(value.endpoint_id, value.queue),
        cause=_CAUSE_TO_PROTO.get(value.cause, dispatch_pb2.DOORBELL_CAUSE_UNSPECIFIED),
        pending=value.pending,
        at=timestamp(value.at),
    )


def set_timestamp(ts: timestamp_pb2.Timestamp, value: datetime) -> None:
    """Sets a Timestamp in place to a datetime, as ``timestamp`` computes it."""
    if value.tzinfo is None:
        ts.FromDatetime(value)
        return
    delta = value - _EPOCH
    ts.seconds = delta.days * 86400 + delta.seconds
    ts.nanos = delta.microseconds * 1000


def fill_todo(msg: todo_pb2.Todo, value: Todo, endpoint_id: str | None = None) -> None:
    """Writes the wire form of a todo into an empty message, in place: a batch
    fills the items it adds to its response instead of building each todo
    and copying it there (twice as costly). ``endpoint_id``: the todo's
    endpoint as text, when the caller already has it."""
    msg.id = str(value.id)
    queue = msg.queue
    queue.endpoint_id = endpoint_id if endpoint_id is not None else str(value.endpoint_id)
    queue.name = value.queue
    msg.state = TODO_STATE_TO_PROTO[value.state]
    msg.payload = value.payload
    msg.content_type = value.content_type
    msg.attempt = value.attempt
    msg.max_attempts = value.max_attempts
    set_timestamp(msg.next_retry_at, value.next_retry_at)
    if value.lease_expires_at is not None:
        set_timestamp(msg.lease_expires_at, value.lease_expires_at)
    msg.claimant = value.claimant
    msg.last_error = value.last_error
    set_timestamp(msg.created_at, value.created_at)
    set_timestamp(msg.updated_at, value.updated_at)
    if value.finished_at is not None:
        set_timestamp(msg.finished_at, value.finished_at)
    msg.priority = value.priority
    if value.dedup_webhook_id is not None and value.dedup_delivery_id is not None:
        msg.dedup.webhook_id = value.dedup_webhook_id
        msg.dedup.delivery_id = value.dedup_delivery_id
    if value.idempotency_key is not None:
        msg.idempotency_key = value.idempotency_key
    if value.traceparent is not None:
        msg.traceparent = value.traceparent
    if value.schedule_id is not None and value.schedule_slot is not None:
        msg.schedule_id = str(value.schedule_id)
        msg.schedule_slot.FromDatetime(value.schedule_slot)


def todo(
    value: Todo, admission: AdmissionStatus | None = None, result: TodoResult | None = None
) -> todo_pb2.Todo:
    """The wire form of a todo (with its result, when one is given)."""
    msg = todo_pb2.Todo()
    fill_todo(msg, value)
    if admission is not None:
        msg.admission.CopyFrom(admission_status(admission))
    if result is not None:
        msg.result.data = result.data
        msg.result.content_type = result.content_type
    return msg


def attempt(value: Attempt) -> todo_pb2.Attempt:
    """The wire form of an attempt."""
    return todo_pb2.Attempt(
        number=value.number,
        claimed_at=timestamp(value.claimed_at),
        claimant=value.claimant,
        outcome=_OUTCOME[value.outcome],
        finished_at=timestamp(value.finished_at),
        error=value.error,
    )


ITEM_OUTCOME = {
    ItemOutcome.APPLIED: dispatch_pb2.BATCH_ITEM_STATUS_APPLIED,
    ItemOutcome.STALE_LEASE: dispatch_pb2.BATCH_ITEM_STATUS_STALE_LEASE,
    ItemOutcome.NOT_CLAIMED: dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED,
    ItemOutcome.NOT_FOUND: dispatch_pb2.BATCH_ITEM_STATUS_NOT_FOUND,
    # Told apart by the message, and by the todo's state where the answer has one.
    ItemOutcome.CANCELLED: dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED,
}

#: Each action's audit label, as the wire names it.
TODO_ACTION = {
    Action.CANCEL.label: dispatch_pb2.TODO_ACTION_CANCEL,
    Action.REQUEUE.label: dispatch_pb2.TODO_ACTION_REQUEUE,
}


def todo_audit_entry(value: AuditEntry[TodoSelection, int]) -> dispatch_pb2.TodoAuditEntry:
    """The wire form of one audited cancel or requeue."""
    todos = value.subject
    return audit_entry(
        dispatch_pb2.TodoAuditEntry,
        value,
        action=TODO_ACTION.get(value.action, dispatch_pb2.TODO_ACTION_UNSPECIFIED),
        endpoint_id=str(value.endpoint_id),
        todo_id=str(todos.todo_id) if todos.todo_id is not None else "",
        count=value.change,
        filter=todos.filter or "",
        todo_ids=todos.todo_ids,
    )


def settlement_result(todo_id: int, value: SettledState) -> dispatch_pb2.SettlementResult:
    """The wire form of what SettleTodos did with one todo."""
    msg = dispatch_pb2.SettlementResult(todo_id=str(todo_id), status=ITEM_OUTCOME[value.outcome])
    if value.state is not None:
        msg.state = TODO_STATE_TO_PROTO[value.state]
        if value.outcome is ItemOutcome.APPLIED and value.state is TodoState.PENDING:
            assert value.next_retry_at is not None
            msg.next_retry_at.FromDatetime(value.next_retry_at)
    if value.outcome is not ItemOutcome.APPLIED:
        msg.message = refusal_message(value.outcome, value.state)
    return msg


def lease(value: Lease) -> todo_pb2.Lease:
    """The wire form of a lease."""
    return todo_pb2.Lease(lease_id=str(value.lease_id), expires_at=timestamp(value.expires_at))


def fill_lease(msg: todo_pb2.Lease, value: Lease) -> None:
    """Writes the wire form of a lease into an empty message, in place (see ``fill_todo``)."""
    msg.lease_id = str(value.lease_id)
    set_timestamp(msg.expires_at, value.expires_at)


def owner(value: Owner) -> admin_pb2.Owner:
    """The wire form of an owner."""
    return admin_pb2.Owner(
        id=str(value.id), name=value.name, created_at=timestamp(value.created_at)
    )


def human(value: Human) -> admin_pb2.Human:
    """The wire form of a human."""
    return admin_pb2.Human(
        id=str(value.id),
        owner_id=str(value.owner_id),
        name=value.name,
        created_at=timestamp(value.created_at),
    )


def endpoint(value: Endpoint) -> admin_pb2.Endpoint:
    """The wire form of an endpoint (never its hook secrets)."""
    msg = admin_pb2.Endpoint(
        id=str(value.id),
        owner_id=str(value.owner_id),
        name=value.name,
        created_at=timestamp(value.created_at),
        notify_url=value.notify_url or "",
    )
    if value.notify_url is not None:
        msg.notify_hook_status.CopyFrom(
            admin_pb2.NotifyHookStatus(
                last_error=value.hook_last_error or "",
                last_error_at=timestamp(value.hook_last_error_at),
                last_success_at=timestamp(value.hook_last_success_at),
                consecutive_failures=value.hook_failures,
                previous_secret_expires_at=timestamp(value.previous_secret_until),
            )
        )
    return msg


def credential(value: Credential) -> admin_pb2.Credential:
    """The wire form of a credential (never its secret)."""
    return admin_pb2.Credential(
        id=str(value.id),
        kind=KIND_TO_PROTO[value.kind],
        owner_id=str(value.owner_id or ""),
        human_id=str(value.human_id or ""),
        endpoint_id=str(value.endpoint_id or ""),
        vended_by_human_id=str(value.vended_by_human_id or ""),
        grants=sorted(GRANT_TO_PROTO[g] for g in value.grants),
        label=value.label,
        created_at=timestamp(value.created_at),
        revoked_at=timestamp(value.revoked_at),
    )
