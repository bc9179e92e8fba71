"""The time zones windows are computed in: the bundled ``tzdata``, never the host's.

Zones are loaded from the ``tzdata`` PyPI package (a declared dependency)
with :meth:`zoneinfo.ZoneInfo.from_file`, never from the host.  A plain
``zoneinfo.ZoneInfo(key)`` searches ``zoneinfo.TZPATH`` (``/usr/share/zoneinfo``
and friends) *first* and only falls back to ``tzdata`` when the host has no
such file, so on a host with a system database the system copy silently wins
and the pinned package is ignored.  Window boundaries are persisted as counter
keys, so every server, test and tool must agree on them regardless of the
host's (possibly older or newer) database; hence the bundled copy always
wins here.  The set of valid keys is the package's ``zones`` list, so
host-only keys such as ``localtime`` (which means "whatever this machine is
set to") and path tricks such as ``../etc/passwd`` are rejected.  Loaded zones
are cached per key for the life of the process (``from_file`` instances are
not cached by :mod:`zoneinfo` itself); they never leak out of this module
because every returned datetime is in UTC.

"""

from __future__ import annotations

import functools
import importlib.resources
from zoneinfo import ZoneInfo

from switchboard_server.windows.field_errors import UnknownZoneError


@functools.cache
def _zone_keys() -> frozenset[str]:
    text = importlib.resources.files("tzdata").joinpath("zones").read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


@functools.cache
def _load_bundled(key: str) -> ZoneInfo:
    resource = importlib.resources.files("tzdata.zoneinfo")
    for part in key.split("/"):
        resource = resource.joinpath(part)
    with resource.open("rb") as fh:
        return ZoneInfo.from_file(fh, key=key)


def load_zone(key: str) -> ZoneInfo:
    """Return the zone ``key`` from the bundled ``tzdata`` package.

    Raises :class:`UnknownZoneError` when ``key`` is not an IANA key of that
    database (keys are case-sensitive; the host database is never consulted).
    """
    if not isinstance(key, str) or key not in _zone_keys():
        raise UnknownZoneError("zone", f"unknown IANA time zone {key!r}")
    try:
        return _load_bundled(key)
    except (OSError, ValueError) as exc:
        raise UnknownZoneError("zone", f"cannot load IANA time zone {key!r}: {exc}") from exc
