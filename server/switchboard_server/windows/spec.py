"""How a policy's windows are laid out (:class:`WindowSpec`: a :class:`Period`, a
zone, a local start and a weekday), and one window (:class:`Window`)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from datetime import datetime, time, timedelta

from switchboard_server.windows.field_errors import WindowSpecError
from switchboard_server.windows.zones import load_zone

_ZERO = timedelta(0)
_START_RE = re.compile(r"([01][0-9]|2[0-3]):([0-5][0-9])")


class Period(enum.Enum):
    """Length of an admission window."""

    HOUR = "HOUR"
    DAY = "DAY"
    WEEK = "WEEK"


@dataclass(frozen=True)
class WindowSpec:
    """How an admission policy's windows are laid out.

    ``start`` is the local start time (seconds and microseconds zero; for
    ``HOUR`` only its minute is used).  ``weekday`` is the ISO weekday
    (1 = Monday .. 7 = Sunday) and is required for ``WEEK`` and forbidden
    otherwise.  The zone's existence is checked by :meth:`parse` and by
    :func:`window_at`, not by the constructor, so a stored spec whose zone
    has disappeared can still be represented.
    """

    period: Period
    zone: str
    start: time
    weekday: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.period, Period):
            raise WindowSpecError("period", f"not a Period: {self.period!r}")
        if not isinstance(self.zone, str) or not self.zone:
            raise WindowSpecError("zone", "time zone must be a non-empty IANA key")
        start = self.start
        if (
            not isinstance(start, time)
            or start.tzinfo is not None
            or start.second != 0
            or start.microsecond != 0
        ):
            raise WindowSpecError("start", "start must be a naive time with whole minutes")
        weekday = self.weekday
        if self.period is Period.WEEK:
            if weekday is None:
                raise WindowSpecError("weekday", "weekday is required for WEEK windows")
            if isinstance(weekday, bool) or not isinstance(weekday, int) or not 1 <= weekday <= 7:
                raise WindowSpecError(
                    "weekday", f"weekday must be 1 (Monday) .. 7 (Sunday), got {weekday!r}"
                )
        elif weekday is not None:
            raise WindowSpecError("weekday", "weekday is only allowed for WEEK windows")

    @classmethod
    def parse(cls, period: str, zone: str, start: str, weekday: int | None) -> WindowSpec:
        """Validate user input and build a spec.

        ``period`` is ``"HOUR"``, ``"DAY"`` or ``"WEEK"``; ``zone`` an IANA key
        of the bundled database; ``start`` exactly ``HH:MM`` (24-hour clock,
        two digits each).  Raises :class:`WindowSpecError` (or
        :class:`UnknownZoneError`) naming the first bad field, checked in the
        order period, zone, start, weekday.
        """
        try:
            parsed_period = Period(period)
        except ValueError:
            raise WindowSpecError(
                "period", f"unknown period {period!r}; expected HOUR, DAY or WEEK"
            ) from None
        load_zone(zone)
        match = _START_RE.fullmatch(start) if isinstance(start, str) else None
        if match is None:
            raise WindowSpecError("start", f"start must be 'HH:MM' (00:00..23:59), got {start!r}")
        return cls(parsed_period, zone, time(int(match[1]), int(match[2])), weekday)


@dataclass(frozen=True)
class Window:
    """The half-open interval ``[start, end)``; both ends are UTC-aware.

    ``start`` is the window's counter key.
    """

    start: datetime
    end: datetime

    def __post_init__(self) -> None:
        if self.start.utcoffset() != _ZERO or self.end.utcoffset() != _ZERO:
            raise ValueError(f"window ends must be UTC datetimes: {self.start!r}, {self.end!r}")
        if not self.start < self.end:
            raise ValueError(f"window start {self.start} is not before end {self.end}")

    @property
    def duration(self) -> timedelta:
        """Absolute length of the window."""
        return self.end - self.start
