"""Fixed calendar windows for per-queue admission control (product spec section 4.2).

An admission policy counts claims per *window*.  A window is described by a
:class:`WindowSpec`: a :class:`Period` (``HOUR``, ``DAY`` or ``WEEK``), an IANA
time zone, a local start time ``HH:MM`` and, for ``WEEK`` only, an ISO weekday
(1 = Monday .. 7 = Sunday).  :func:`window_at` maps an instant to the
half-open window ``[start, end)`` that contains it.  Both ends are UTC-aware
datetimes; the counter key of a window is its ``start`` (UTC).

This package is pure: no I/O except reading the bundled time zone database,
no database access, no clock.

The parts: ``spec`` (:class:`WindowSpec`, :class:`Window`), ``zones`` (the bundled
database), ``locate`` (:func:`window_at`), ``calendar_windows`` (``DAY``, ``WEEK``),
``hourly_windows`` (``HOUR``), ``wall_clock`` (local times and instants),
``field_errors``.
"""

from __future__ import annotations

from switchboard_server.windows.field_errors import FieldError as FieldError
from switchboard_server.windows.field_errors import UnknownZoneError as UnknownZoneError
from switchboard_server.windows.field_errors import WindowSpecError as WindowSpecError
from switchboard_server.windows.locate import next_boundary as next_boundary
from switchboard_server.windows.locate import window_at as window_at
from switchboard_server.windows.spec import Period as Period
from switchboard_server.windows.spec import Window as Window
from switchboard_server.windows.spec import WindowSpec as WindowSpec
from switchboard_server.windows.wall_clock import local_to_instant as local_to_instant
from switchboard_server.windows.zones import load_zone as load_zone
