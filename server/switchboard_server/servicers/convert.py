"""Domain records to proto messages."""

from __future__ import annotations

from datetime import datetime

from google.protobuf import timestamp_pb2
from switchboard.v1 import admin_pb2, todo_pb2

from switchboard_server.model import (
    Attempt,
    AttemptOutcome,
    Credential,
    Endpoint,
    Grant,
    Human,
    Lease,
    Owner,
    PrincipalKind,
    Todo,
    TodoState,
)

TODO_STATE_TO_PROTO = {
    TodoState.PENDING: todo_pb2.TODO_STATE_PENDING,
    TodoState.CLAIMED: todo_pb2.TODO_STATE_CLAIMED,
    TodoState.DONE: todo_pb2.TODO_STATE_DONE,
    TodoState.DEAD: todo_pb2.TODO_STATE_DEAD,
}
TODO_STATE_FROM_PROTO = {v: k for k, v in TODO_STATE_TO_PROTO.items()}

_OUTCOME = {
    AttemptOutcome.RUNNING: todo_pb2.ATTEMPT_OUTCOME_RUNNING,
    AttemptOutcome.COMPLETED: todo_pb2.ATTEMPT_OUTCOME_COMPLETED,
    AttemptOutcome.FAILED: todo_pb2.ATTEMPT_OUTCOME_FAILED,
    AttemptOutcome.RELEASED: todo_pb2.ATTEMPT_OUTCOME_RELEASED,
    AttemptOutcome.LAPSED: todo_pb2.ATTEMPT_OUTCOME_LAPSED,
}

GRANT_TO_PROTO = {
    Grant.INGEST: admin_pb2.GRANT_INGEST,
    Grant.CLAIM: admin_pb2.GRANT_CLAIM,
    Grant.READ: admin_pb2.GRANT_READ,
    Grant.SET_ADMISSION_POLICY: admin_pb2.GRANT_SET_ADMISSION_POLICY,
    Grant.CLEAR_ADMISSION_POLICY: admin_pb2.GRANT_CLEAR_ADMISSION_POLICY,
}
GRANT_FROM_PROTO = {v: k for k, v in GRANT_TO_PROTO.items()}

KIND_TO_PROTO = {
    PrincipalKind.OPERATOR: admin_pb2.PRINCIPAL_KIND_OPERATOR,
    PrincipalKind.HUMAN: admin_pb2.PRINCIPAL_KIND_HUMAN,
    PrincipalKind.ENDPOINT: admin_pb2.PRINCIPAL_KIND_ENDPOINT,
}


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    """A Timestamp for an aware datetime; ``None`` stays unset."""
    if value is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value)
    return ts


def todo(value: Todo) -> todo_pb2.Todo:
    """The wire form of a todo."""
    msg = todo_pb2.Todo(
        id=str(value.id),
        queue=todo_pb2.QueueRef(endpoint_id=str(value.endpoint_id), name=value.queue),
        state=TODO_STATE_TO_PROTO[value.state],
        payload=value.payload,
        content_type=value.content_type,
        attempt=value.attempt,
        max_attempts=value.max_attempts,
        next_retry_at=timestamp(value.next_retry_at),
        lease_expires_at=timestamp(value.lease_expires_at),
        claimant=value.claimant,
        last_error=value.last_error,
        created_at=timestamp(value.created_at),
        updated_at=timestamp(value.updated_at),
        finished_at=timestamp(value.finished_at),
    )
    if value.dedup_webhook_id is not None and value.dedup_delivery_id is not None:
        msg.dedup.webhook_id = value.dedup_webhook_id
        msg.dedup.delivery_id = value.dedup_delivery_id
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


def lease(value: Lease) -> todo_pb2.Lease:
    """The wire form of a lease."""
    return todo_pb2.Lease(lease_id=str(value.lease_id), expires_at=timestamp(value.expires_at))


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
    """The wire form of an endpoint."""
    return admin_pb2.Endpoint(
        id=str(value.id),
        owner_id=str(value.owner_id),
        name=value.name,
        created_at=timestamp(value.created_at),
    )


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
