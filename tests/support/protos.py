"""Converting between protobuf well-known types and Python values in tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from google.protobuf import duration_pb2, timestamp_pb2


def at(ts: timestamp_pb2.Timestamp) -> datetime:
    """An aware datetime from a Timestamp."""
    return ts.ToDatetime(tzinfo=UTC)


def dur(value: timedelta | int = 0, nanos: int = 0) -> duration_pb2.Duration:
    """A protobuf Duration from a timedelta, or from raw ``seconds`` and ``nanos``.

    ``dur(timedelta(hours=1))`` converts (and normalises) a timedelta.
    ``dur(seconds, nanos)`` sets the two fields exactly as given, without
    normalising or range checks, so a test can send durations no timedelta
    can express (negative nanos, 10**14 seconds).
    """
    if isinstance(value, timedelta):
        assert not nanos, "give nanos only with raw seconds"
        d = duration_pb2.Duration()
        d.FromTimedelta(value)
        return d
    return duration_pb2.Duration(seconds=value, nanos=nanos)
