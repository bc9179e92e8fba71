"""Request field validation: every problem is collected, then raised as one
``InvalidArgument`` naming each field, before anything is written."""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Literal, Protocol, TypeVar

from google.protobuf import duration_pb2, timestamp_pb2

from switchboard_server import errors
from switchboard_server.model import TodoResult

QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
MAX_PAYLOAD_BYTES = 1024 * 1024
MAX_CONTENT_TYPE = 255
#: The content type of a payload or result that names none.
DEFAULT_CONTENT_TYPE = "application/octet-stream"
MAX_DEDUP_PART = 200
#: How long an idempotency key may deduplicate after its todo finished.
MAX_IDEMPOTENCY_RETENTION = timedelta(days=30)
MAX_CLAIMANT = 200
MAX_ERROR = 4096
#: Bytes of a result a worker may leave with Complete.
MAX_RESULT_BYTES = 64 * 1024
#: Characters of ListTodos' error_contains filter.
MAX_ERROR_FILTER = 200
MAX_NAME = 100
MAX_LABEL = 200
MAX_URL = 2048
#: IANA zone keys are at most 30-odd characters; anything longer is not one.
MAX_ZONE = 64
#: A window start is ``HH:MM``; the parser says so for anything up to this long.
MAX_START = 16
MAX_QUEUES_PER_CALL = 100
MIN_LEASE = timedelta(seconds=1)
MAX_LEASE = timedelta(hours=24)
MAX_DELAY = timedelta(days=365)
MAX_ATTEMPTS_LIMIT = 100
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
MAX_TODO_ID = 2**63 - 1
#: Todos per ClaimNext, and items per HeartbeatTodos or SettleTodos call.
MAX_BATCH = 500
#: Digits of the largest todo id; longer digit strings are never parsed (an
#: int() of thousands of digits is slow, and past 4,300 it raises).
MAX_TODO_ID_DIGITS = len(str(MAX_TODO_ID))
#: A page token is base64 of ``v1:<todo id>``; far shorter than this.
MAX_PAGE_TOKEN = 64
#: The Timestamp range (0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z), in seconds.
_MIN_TIMESTAMP = -62_135_596_800
_MAX_TIMESTAMP = 253_402_300_799
UUID_TEXT = re.compile(
    r"[0-9A-Fa-f]{8}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{12}"
)

#: What no name, label, claimant, key or other identifier-like text may hold:
#: control characters (C0 including NUL, DEL, C1), the line and paragraph
#: separators, surrogates and the Unicode noncharacters. NUL is also the one
#: character PostgreSQL text and jsonb reject; the rest break log lines,
#: tables and terminals, or are not characters at all.
_NOT_PRINTABLE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\ufdd0-\ufdef"
    + "".join(rf"\U{plane:04x}fffe\U{plane:04x}ffff" for plane in range(17))
    + "]"
)
#: Free text stores every character but NUL, which becomes this.
NUL_REPLACEMENT = "\ufffd"


def printable(value: str) -> bool:
    """Whether ``value`` holds none of the characters identifiers may not hold."""
    return _NOT_PRINTABLE.search(value) is None


def free_text(value: str, *, maximum: int) -> str:
    """Free text as stored: cut to ``maximum`` characters, each NUL replaced by U+FFFD.

    Used for text the server keeps but never interprets (a failed attempt's
    error), where refusing the call would lose the report it carries: a
    worker whose Fail were refused would leave its todo to lapse and run again.
    """
    return value[:maximum].replace("\x00", NUL_REPLACEMENT)


class LeaseItem(Protocol):
    """A request item naming a claimed todo and its lease."""

    @property
    def todo_id(self) -> str: ...

    @property
    def lease_id(self) -> str: ...


class PageRequest(Protocol):
    """A request for a page of a list."""

    @property
    def page_size(self) -> int: ...

    @property
    def page_token(self) -> str: ...


class LeaseRequest(Protocol):
    """A request with an optional lease length."""

    @property
    def lease_duration(self) -> duration_pb2.Duration: ...

    def HasField(self, field_name: Literal["lease_duration"]) -> bool: ...


K = TypeVar("K")
T = TypeVar("T")
V = TypeVar("V")


class Violations:
    """Collects field violations; ``check()`` raises them all at once."""

    def __init__(self) -> None:
        self._items: list[errors.FieldViolation] = []

    @classmethod
    def checked(cls, read: Callable[[Violations], T]) -> T:
        """What ``read`` makes of a request's fields through a new collector,
        once ``check()`` passed: a request read by one call."""
        v = cls()
        value = read(v)
        v.check()
        return value

    def add(self, field: str, description: str) -> None:
        """Records one problem."""
        self._items.append(errors.FieldViolation(field, description))

    def __len__(self) -> int:
        return len(self._items)

    def check(self) -> None:
        """Raises ``InvalidArgument`` if anything was recorded."""
        if self._items:
            raise errors.InvalidArgument(self._items)

    def queue_name(self, field: str, value: str) -> str:
        """A queue name."""
        if not QUEUE_NAME.fullmatch(value):
            self.add(
                field,
                "must be 1-64 characters of letters, digits and _ . : -, "
                "starting with a letter or digit",
            )
        return value

    def name(self, field: str, value: str) -> str:
        """An owner's, human's or endpoint's name: required, at most ``MAX_NAME``
        characters of one-line text."""
        return self.text(field, value, maximum=MAX_NAME, required=True)

    def queue_names(self, field: str, values: Iterable[str]) -> list[str]:
        """A list of queue names (may be empty)."""
        names = list(values)
        if len(names) > MAX_QUEUES_PER_CALL:
            self.add(field, f"at most {MAX_QUEUES_PER_CALL} queues")
            return names
        for i, name in enumerate(names):
            self.queue_name(f"{field}[{i}]", name)
        return list(dict.fromkeys(names))

    def members(self, field: str, values: Iterable[K], table: Mapping[K, V], what: str) -> list[V]:
        """Each of ``values`` as ``table`` maps it (a proto enum's to the domain's);
        each one it does not map is a violation at ``field[i]``: must be a ``what``."""
        found: list[V] = []
        for i, value in enumerate(values):
            if value in table:
                found.append(table[value])
            else:
                self.add(f"{field}[{i}]", f"must be a {what}")
        return found

    def parse_uuid(self, field: str, value: str, *, required: bool) -> uuid.UUID | None:
        """A UUID field; empty is ``None`` unless required."""
        if not value:
            if required:
                self.add(field, "required")
            return None
        # uuid.UUID alone would take braces, "urn:uuid:", underscores and
        # non-ASCII digits; an id is 32 hex digits, hyphens optional.
        if not UUID_TEXT.fullmatch(value):
            self.add(field, "must be a UUID")
            return None
        return uuid.UUID(value)

    def required_uuid(self, field: str, value: str) -> uuid.UUID:
        """A required UUID field (the nil UUID when it is not one, a violation
        then recorded)."""
        parsed = self.parse_uuid(field, value, required=True)
        return parsed or uuid.UUID(int=0)

    def row_id(self, field: str, value: str, what: str) -> int:
        """A stored row's id (a todo's, a schedule's): a positive decimal integer
        (0 when it is not one, a violation then recorded: must be a ``what``)."""
        if (
            len(value) > MAX_TODO_ID_DIGITS
            or not value.isascii()
            or not value.isdigit()
            or not 0 < int(value) <= MAX_TODO_ID
        ):
            self.add(field, f"must be a {what} (a positive integer)")
            return 0
        return int(value)

    def todo_id(self, field: str, value: str) -> int:
        """A todo id: a positive decimal integer."""
        return self.row_id(field, value, "todo id")

    def schedule_id(self, field: str, value: str) -> int:
        """A schedule id: a positive decimal integer."""
        return self.row_id(field, value, "schedule id")

    def lease_id(self, field: str, value: str) -> uuid.UUID:
        """A lease id from a claim."""
        return self.required_uuid(field, value)

    def lease_ref(self, request: LeaseItem) -> tuple[int, uuid.UUID]:
        """A request's ``todo_id`` and the ``lease_id`` of its claim."""
        return self.todo_id("todo_id", request.todo_id), self.lease_id("lease_id", request.lease_id)

    def duration(
        self,
        field: str,
        value: duration_pb2.Duration,
        present: bool,
        *,
        minimum: timedelta,
        maximum: timedelta,
    ) -> timedelta | None:
        """An optional duration within bounds; ``None`` when absent."""
        if not present:
            return None
        if value.nanos < 0 or value.seconds < 0:
            self.add(field, "must not be negative")
            return None
        if value.nanos > 999_999_999 or value.seconds > maximum.total_seconds():
            self.add(field, f"must be between {minimum} and {maximum}")
            return None
        delta = value.ToTimedelta()
        if not minimum <= delta <= maximum:
            self.add(field, f"must be between {minimum} and {maximum}")
            return None
        return delta

    def timestamp(
        self, field: str, value: timestamp_pb2.Timestamp, present: bool
    ) -> datetime | None:
        """An optional point in time (years 1 to 9999); ``None`` when absent."""
        if not present:
            return None
        if not (
            _MIN_TIMESTAMP <= value.seconds <= _MAX_TIMESTAMP and 0 <= value.nanos <= 999_999_999
        ):
            self.add(field, "must be a time between the years 1 and 9999")
            return None
        return value.ToDatetime(UTC)

    def dedup(self, field: str, webhook_id: str, delivery_id: str) -> tuple[str, str]:
        """A dedup key: both parts required, each one-line text of at most
        ``MAX_DEDUP_PART`` characters."""
        return (
            self.text(f"{field}.webhook_id", webhook_id, maximum=MAX_DEDUP_PART, required=True),
            self.text(f"{field}.delivery_id", delivery_id, maximum=MAX_DEDUP_PART, required=True),
        )

    def result(self, field: str, data: bytes, content_type: str) -> TodoResult:
        """A completion's result: at most ``MAX_RESULT_BYTES`` of data and a content
        type (application/octet-stream when empty)."""
        if len(data) > MAX_RESULT_BYTES:
            self.add(f"{field}.data", f"at most {MAX_RESULT_BYTES} bytes")
        content_type = self.text(f"{field}.content_type", content_type, maximum=MAX_CONTENT_TYPE)
        return TodoResult(data, content_type or DEFAULT_CONTENT_TYPE)

    def lease(self, request: LeaseRequest) -> timedelta | None:
        """A request's optional ``lease_duration`` (``MIN_LEASE`` to ``MAX_LEASE``)."""
        return self.duration(
            "lease_duration",
            request.lease_duration,
            request.HasField("lease_duration"),
            minimum=MIN_LEASE,
            maximum=MAX_LEASE,
        )

    def text(self, field: str, value: str, *, maximum: int, required: bool = False) -> str:
        """A name, label, claimant, key or other one-line text: at most ``maximum``
        characters, none of them a control character (NUL included), a line
        separator or a noncharacter (see ``printable``)."""
        if required and not value.strip():
            self.add(field, "required")
        elif len(value) > maximum:
            self.add(field, f"at most {maximum} characters")
        elif not printable(value):
            self.add(field, "must not contain control characters (NUL included) or noncharacters")
        return value.strip() if required else value

    def url(self, field: str, value: str) -> str:
        """An absolute http(s) URL in printable ASCII (an international host or
        path is sent in its ASCII form: punycode, percent-encoding)."""
        if len(value) > MAX_URL or not value.isascii():
            parsed = None
        else:
            try:
                parsed = urllib.parse.urlsplit(value)
                parsed.port  # noqa: B018 - raises for a port that is not one
            except ValueError:
                parsed = None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
            self.add(
                field,
                f"must be an http:// or https:// URL of at most {MAX_URL} ASCII characters",
            )
        elif any(ord(c) <= 32 or ord(c) == 127 for c in value):
            self.add(field, "must not contain spaces or control characters")
        return value

    def page_token(self, field: str, token: str) -> int | None:
        """The position inside a page token (``None`` for the first page)."""
        if not token:
            return None
        if len(token) > MAX_PAGE_TOKEN or not token.isascii():
            self.add(field, "not a page token from this list")
            return None
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        except (ValueError, binascii.Error, UnicodeDecodeError):
            raw = ""
        version, _, value = raw.partition(":")
        if (
            version != "v1"
            or not value.isascii()
            or not value.isdigit()
            or not (0 < int(value) <= MAX_TODO_ID)
        ):
            self.add(field, "not a page token from this list")
            return None
        return int(value)

    def batch_size(self, field: str, value: int) -> int:
        """How many todos a ClaimNext may claim; 0 means 1."""
        if value == 0:
            return 1
        if not 1 <= value <= MAX_BATCH:
            self.add(field, f"must be between 1 and {MAX_BATCH}")
        return value

    def lease_refs(self, field: str, items: Sequence[LeaseItem]) -> list[tuple[int, uuid.UUID]]:
        """1 to ``MAX_BATCH`` (todo id, lease id) pairs, each todo at most once."""
        if not 1 <= len(items) <= MAX_BATCH:
            self.add(field, f"must hold between 1 and {MAX_BATCH} items")
        refs, seen = [], set()
        for i, item in enumerate(items):
            # Each item's field names are formatted only when its value needs
            # the full check (a batch holds up to MAX_BATCH items).
            raw_id, raw_lease = item.todo_id, item.lease_id
            valid_id = (
                len(raw_id) <= MAX_TODO_ID_DIGITS
                and raw_id.isascii()
                and raw_id.isdigit()
                and 0 < (todo_id := int(raw_id)) <= MAX_TODO_ID
            )
            if not valid_id:
                todo_id = self.todo_id(f"{field}[{i}].todo_id", raw_id)
            if raw_lease and UUID_TEXT.fullmatch(raw_lease):
                lease_id = uuid.UUID(raw_lease)
            else:
                lease_id = self.lease_id(f"{field}[{i}].lease_id", raw_lease)
            if todo_id and todo_id in seen:
                self.add(f"{field}[{i}].todo_id", "names a todo already in this call")
            seen.add(todo_id)
            refs.append((todo_id, lease_id))
        return refs

    def page(self, request: PageRequest) -> tuple[int, int | None]:
        """A list request's ``page_size`` and the position its ``page_token`` holds."""
        return self.page_size("page_size", request.page_size), self.page_token(
            "page_token", request.page_token
        )

    def page_size(self, field: str, value: int) -> int:
        """A page size; 0 means the default."""
        if value == 0:
            return DEFAULT_PAGE_SIZE
        if not 1 <= value <= MAX_PAGE_SIZE:
            self.add(field, f"must be between 1 and {MAX_PAGE_SIZE}")
        return value


def page_token_after(last_id: int) -> str:
    """An opaque page token for the page after the item with id ``last_id``."""
    return base64.urlsafe_b64encode(f"v1:{last_id}".encode()).decode().rstrip("=")


def next_page_token(after: int | None) -> str:
    """The token of the page that goes on after the item with id ``after``
    (empty when no page follows: ``after`` is ``None``)."""
    return page_token_after(after) if after is not None else ""
