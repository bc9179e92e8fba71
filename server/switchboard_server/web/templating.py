"""Rendering for the board: Jinja2 templates (autoescaped) and static files.

Templates and static files ship as package data under ``web/templates`` and
``web/static`` and are read through ``importlib.resources``, so they work
from a wheel as well as from the source tree.
"""

from __future__ import annotations

import hashlib
import mimetypes
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import quote

import jinja2

from switchboard_server.policies import Limits, Policy
from switchboard_server.windows import UnknownZoneError, load_zone

WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


@dataclass(frozen=True)
class StaticFile:
    """A static asset held in memory, with a content hash for cache busting."""

    body: bytes
    content_type: str
    version: str


def load_static() -> dict[str, StaticFile]:
    """Every file in the package's ``web/static`` folder, by name."""
    files: dict[str, StaticFile] = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        if not entry.is_file():
            continue
        body = entry.read_bytes()
        content_type = mimetypes.guess_type(entry.name)[0] or "application/octet-stream"
        files[entry.name] = StaticFile(body, content_type, hashlib.sha256(body).hexdigest()[:12])
    return files


def zone_names() -> list[str]:
    """The IANA zone keys of the bundled ``tzdata`` (the ones a policy may name)."""
    text = resources.files("tzdata").joinpath("zones").read_text(encoding="utf-8")
    return sorted(line.strip() for line in text.splitlines() if line.strip())


def iso(at: datetime) -> str:
    """An instant as RFC 3339 UTC, for ``<time datetime>``."""
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def in_zone(at: datetime, zone: str | None) -> str:
    """``YYYY-MM-DD HH:MM ABBR`` in an IANA zone (UTC when the zone is unknown)."""
    try:
        tz = load_zone(zone or "UTC")
    except UnknownZoneError:
        tz = load_zone("UTC")
    return at.astimezone(tz).strftime("%Y-%m-%d %H:%M %Z")


def relative(at: datetime, now: datetime) -> str:
    """``in 3 h 5 min`` or ``12 min ago``, to the minute."""
    seconds = int((at - now).total_seconds())
    minutes = (abs(seconds) + 59) // 60
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    parts = [f"{days} d"] if days else []
    if hours:
        parts.append(f"{hours} h")
    if mins or not parts:
        parts.append(f"{mins} min")
    text = " ".join(parts)
    return f"in {text}" if seconds >= 0 else f"{text} ago"


def policy_text(policy: Policy | None) -> str:
    """A policy in one line, e.g. ``at most 5 in flight; 100 claims per day from 00:00 …``
    (``… (template inv:*)`` when it is a template's)."""
    if policy is None:
        return "none (admits everything)"
    text = limits_text(policy.limits)
    return f"{text} (template {policy.template})" if policy.template is not None else text


def limits_text(limits: Limits) -> str:
    """A policy's (or a template's) limits in one line."""
    parts = []
    if limits.max_in_flight is not None:
        parts.append(
            "0 in flight (paused)"
            if limits.max_in_flight == 0
            else f"at most {limits.max_in_flight} in flight"
        )
    if limits.max_claims_per_window is not None and limits.window is not None:
        w = limits.window
        day = f" {WEEKDAYS[w.weekday - 1]}" if w.weekday else ""
        paused = " (paused)" if limits.max_claims_per_window == 0 else ""
        parts.append(
            f"{limits.max_claims_per_window} claims per {w.period.value.lower()}{paused}, "
            f"from{day} {w.start.strftime('%H:%M')} {w.zone}"
        )
    return "; ".join(parts)


def queue_url(endpoint_id: uuid.UUID, queue: str) -> str:
    """The board's page of one queue."""
    return f"/board/queues/{endpoint_id}/{quote(queue, safe='')}"


def template_url(endpoint_id: uuid.UUID, pattern: str) -> str:
    """The board's page of one policy template's queues."""
    return f"/board/templates/{endpoint_id}/{quote(pattern, safe='')}"


class Renderer:
    """The board's Jinja2 environment."""

    def __init__(self, static: dict[str, StaticFile]) -> None:
        self._static = static
        self.env = jinja2.Environment(
            loader=jinja2.PackageLoader("switchboard_server.web", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(
            iso=iso,
            in_zone=in_zone,
            relative=relative,
            policy_text=policy_text,
            limits_text=limits_text,
        )
        self.env.globals.update(
            static=self.static_url, queue_url=queue_url, template_url=template_url
        )

    def static_url(self, name: str) -> str:
        """The URL of a static file, versioned by its content."""
        return f"/board/static/{name}?v={self._static[name].version}"

    def render(self, template: str, **context: Any) -> str:
        """Renders a page; ``session`` and ``observed_at`` default to none."""
        context.setdefault("session", None)
        context.setdefault("observed_at", None)
        return self.env.get_template(template).render(**context)
