"""A claim's admission report: the ``admission`` JSON that ``sb_claim`` and
``sb_claim_next_for`` answer (``db/functions/fn_claim.sql``, ``fn_admission.sql``),
decoded once, here, into typed values. ``policies.py`` turns them into the
domain's ``Headroom`` and ``Deferral``.

The JSON is ``{"headroom": ..., "deferred": [...]}``, each key optional: the
headroom of a claim admitted under a policy (``sb_headroom_after``), and the
queues a policy deferred (``sb_deferral_json``, with ``pending`` and the
shared clock's ``now``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from switchboard_server.db.queries import Params


@dataclass(frozen=True)
class PolicyLimitColumns(Params):
    """A policy's limits as stored (``admission_policies``): what a policy row,
    ``sb_policy_json`` and the queue overview each carry (``None``: no such
    limit, or no window). As a group of parameters (a row that carries them
    too), the six columns a policy or template write takes."""

    max_in_flight: int | None
    max_claims_per_window: int | None
    window_period: str | None
    window_zone: str | None
    #: ``HH:MM``.
    window_start: str | None
    window_weekday: int | None


@dataclass(frozen=True)
class ReportedPolicy(PolicyLimitColumns):
    """The policy a claim was admitted under, as ``sb_policy_json`` writes it."""

    updated_at: datetime


@dataclass(frozen=True)
class ReportedHeadroom:
    """What was left of a budget after the claim (``sb_headroom_after``)."""

    window_used: int | None
    window_limit: int | None
    resets_at: datetime | None
    in_flight_used: int | None
    in_flight_limit: int | None
    policy: ReportedPolicy


@dataclass(frozen=True)
class ReportedDeferral:
    """A queue a policy deferred: why (a ``DeferralReason`` value), its pending
    todos, and the instants its next eligible time is made of."""

    queue: str
    reason: str
    pending: int
    window_end: datetime | None
    earliest_expiry: datetime | None
    #: The shared clock's time of the refusal.
    observed_at: datetime | None


@dataclass(frozen=True)
class AdmissionReport:
    """A claim's admission report."""

    #: Whether the claim was admitted under a policy lock (the report carries
    #: a headroom): its transaction may have committed before its WAL flush.
    admitted: bool = False
    headroom: ReportedHeadroom | None = None
    deferred: tuple[ReportedDeferral, ...] = ()


#: The report of a claim no policy had a word on.
NO_REPORT = AdmissionReport()


def admission_report(text: str | None) -> AdmissionReport:
    """The report in a claim function's ``admission`` column (``None`` or
    empty: ``NO_REPORT``)."""
    if not text:
        return NO_REPORT
    data = json.loads(text)
    headroom = data.get("headroom")
    return AdmissionReport(
        "headroom" in data,
        _headroom(headroom) if headroom else None,
        tuple(_deferral(d) for d in data.get("deferred", [])),
    )


def _instant(value: Any) -> datetime | None:
    if not value:
        return None
    parsed = datetime.fromisoformat(str(value))
    assert parsed.tzinfo is not None
    return parsed


def reported_policy(data: Mapping[str, Any]) -> ReportedPolicy:
    """A policy as ``sb_policy_json`` (or the audit, ``policy_json``) writes it."""
    updated_at = _instant(data["updated_at"])
    assert updated_at is not None
    return ReportedPolicy(
        data.get("max_in_flight"),
        data.get("max_claims_per_window"),
        data.get("window_period") or None,
        data.get("window_zone"),
        data.get("window_start"),
        data.get("window_weekday"),
        updated_at,
    )


def _headroom(data: Mapping[str, Any]) -> ReportedHeadroom:
    return ReportedHeadroom(
        window_used=data.get("window_used"),
        window_limit=data.get("window_limit"),
        resets_at=_instant(data.get("resets_at")),
        in_flight_used=data.get("in_flight_used"),
        in_flight_limit=data.get("in_flight_limit"),
        policy=reported_policy(data["policy"]),
    )


def _deferral(data: Mapping[str, Any]) -> ReportedDeferral:
    return ReportedDeferral(
        str(data["queue"]),
        str(data["reason"]),
        int(data.get("pending") or 0),
        _instant(data.get("window_end")),
        _instant(data.get("earliest_expiry")),
        _instant(data.get("now")),
    )
