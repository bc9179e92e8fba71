"""Which window of a spec an instant is in (:func:`window_at`), and when it ends.

Cost
----
:func:`window_at` is called on claim paths.  It does a handful of
``ZoneInfo`` conversions (about five) and no loops over hours or days; only
when a transition is within reach does it bisect for the transition instant
(about 12-17 extra conversions; tzif transitions are whole seconds).  It
relies on the fact, true of every zone in the database since 1970, that
offset changes are at least days apart: a zone never changes offset and back
within one window.
"""

from __future__ import annotations

from datetime import UTC, datetime

from switchboard_server.windows.calendar_windows import calendar_window
from switchboard_server.windows.hourly_windows import hour_ceil, hour_floor
from switchboard_server.windows.spec import Period, Window, WindowSpec
from switchboard_server.windows.zones import load_zone


def window_at(spec: WindowSpec, instant: datetime) -> Window:
    """Return the window of ``spec`` containing ``instant`` (``start <= instant < end``).

    ``instant`` must be timezone-aware (naive -> :class:`ValueError`).  Raises
    :class:`UnknownZoneError` if ``spec.zone`` is not in the bundled
    database, and :class:`ValueError` if the window would fall outside the
    range of :class:`datetime`.
    """
    if not isinstance(instant, datetime):
        raise TypeError(f"instant must be a datetime, got {type(instant).__name__}")
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError("instant must be timezone-aware")
    tz = load_zone(spec.zone)
    try:
        at = instant.astimezone(UTC)
        if spec.period is Period.HOUR:
            minute = spec.start.minute
            start, end = hour_floor(tz, at, minute), hour_ceil(tz, at, minute)
        else:
            start, end = calendar_window(tz, at, spec)
    except OverflowError as exc:
        raise ValueError(f"instant {instant!r} is too close to the datetime range limits") from exc
    return Window(start, end)


def next_boundary(spec: WindowSpec, instant: datetime) -> datetime:
    """Return the end of the window containing ``instant`` (UTC)."""
    return window_at(spec, instant).end
