"""Hostile input on every RPC of the four services, against a live server.

Hypothesis builds request messages for each RPC (strings with NUL, control
characters, noncharacters and every other Unicode scalar value protobuf can
carry, very long strings; int32/int64 bounds; negative and huge durations; far
timestamps; unknown enum values; random payloads; repeated fields with
duplicates and many items) and sends them with real tokens (the operator, a
human, endpoint credentials with and without budget grants) and bad ones.
Raw bytes that are not a valid message (garbage, and string fields holding
invalid UTF-8 such as encoded surrogates, which no Python client can build
but any other client can send) go to every method over a raw channel.

Whatever the request, the answer is never ``INTERNAL`` or ``UNKNOWN`` (a bug,
SPEC section 6), nor any other code a request cannot earn; after each RPC's
run the server still serves (health, a normal ingest and ClaimNext), and the
database invariants hold: no claimed todo without a lease, ``attempt <=
max_attempts``, and the charged units of the budgeted queue equal its
attempts in each window.

The runs are derandomized, so a failure reproduces; a failure prints the RPC,
the token and (cut) the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from google.protobuf import descriptor, duration_pb2, timestamp_pb2
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switchboard_dispatch.v1 import (
    admin_pb2,
    admission_pb2,
    dispatch_pb2,
    queue_pb2,
    schedule_pb2,
    todo_pb2,
)
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database

from tests.support.client import (
    OPERATOR_TOKEN,
    SECRET_KEYS,
    Client,
    add_endpoint,
    auth,
    make_tenant,
)
from tests.support.databases import DatabaseFactory
from tests.support.errors import field_path_resolves, field_violations, rich_status
from tests.support.resolver import StaticResolver

if TYPE_CHECKING:
    from tests.support.errors import MessageDescriptor

Metadata = tuple[tuple[str, str], ...]

#: Every code a request may earn. INTERNAL and UNKNOWN are bugs; UNAVAILABLE,
#: ABORTED and DEADLINE_EXCEEDED would mean the server or database struggled
#: with one sequential caller, which is a bug here too.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

#: The queue whose budget the invariants check. No fuzzed policy call can name
#: it (its schedule never changes, so units == attempts holds per window).
BUDGETED = "budgeted"
WINDOW_LIMIT = 40
#: A queue only the final check uses.
AFTER = "after-fuzz"

FUZZ_SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# --- the world the requests point into ------------------------------------------


@dataclass
class World:
    """Real ids and tokens for the strategies to draw from; grows as calls succeed."""

    client: Client
    db: Database
    tokens: dict[str, Metadata]
    hook_tokens: dict[str, Metadata]
    endpoint_ids: list[str]
    owner_ids: list[str]
    revocable: list[str]
    hook_endpoint_id: str
    todo_ids: list[str] = field(default_factory=list)
    leases: list[tuple[str, str]] = field(default_factory=list)
    schedule_ids: list[str] = field(default_factory=list)

    def harvest(self, response: Message) -> None:
        """Remembers the todos and leases a successful call returned."""
        if isinstance(response, dispatch_pb2.IngestResponse):
            self.todo_ids.append(response.todo.id)
        elif isinstance(response, dispatch_pb2.ClaimResponse | dispatch_pb2.ClaimNextResponse):
            if response.todo.id:
                self.leases.append((response.todo.id, response.lease.lease_id))
            if isinstance(response, dispatch_pb2.ClaimNextResponse):
                self.leases.extend((c.todo.id, c.lease.lease_id) for c in response.claimed)
        elif isinstance(response, admin_pb2.VendCredentialResponse):
            self.revocable.append(response.credential.id)
        elif isinstance(response, schedule_pb2.CreateScheduleResponse):
            self.schedule_ids.append(response.schedule.id)


@pytest.fixture(scope="module")
async def world(
    db_factory: DatabaseFactory, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[World]:
    """One server for the module, and the world of :func:`open_world` on it."""
    dsn = await db_factory.create()
    settings_ = Settings(
        database_url=dsn,
        data_dir=tmp_path_factory.mktemp("fuzz"),
        listen="127.0.0.1:0",
        http_listen="127.0.0.1:0",
        operator_token=OPERATOR_TOKEN,
        reaper_interval=timedelta(hours=1),
        retention_interval=timedelta(hours=1),
        secret_keys=SECRET_KEYS,
        # Loopback hooks are valid; fuzzed host names never reach real DNS.
        hooks_allow_private=True,
        hook_resolver=StaticResolver(),
    )
    running = await server_app.start(settings_)
    try:
        async with open_world(running.address, dsn) as w:
            yield w
    finally:
        await running.stop(grace=1)


@contextlib.asynccontextmanager
async def open_world(address: str, dsn: str, tag: str = "") -> AsyncIterator[World]:
    """On the server at ``address`` (its database at ``dsn``): a tenant with a
    budgeted queue, claimed todos, an endpoint with every grant, and an owner
    of its own for notify hooks (owner names end with ``tag``)."""
    client = Client(address)
    db = await Database.connect(dsn, min_size=1, max_size=2)
    try:
        tenant = await make_tenant(client, "acme" + tag)
        full_id, full_token = await add_endpoint(
            client, tenant, "full", grants=list(admin_pb2.Grant.values())[1:]
        )
        other = await make_tenant(client, "other" + tag)
        # Hooks are set only on this owner's endpoint, whose tokens no other
        # call uses: it never has work, so no fuzzed URL is ever called.
        hooked = await make_tenant(client, "hooked" + tag)
        victim = await client.admin.VendCredential(
            admin_pb2.VendCredentialRequest(
                endpoint_id=tenant.endpoint_id, presets=[admin_pb2.GRANT_PRESET_BASICS]
            ),
            metadata=tenant.human,
        )
        await client.admission.SetPolicy(
            admission_pb2.SetPolicyRequest(
                policy=admission_pb2.AdmissionPolicy(
                    queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name=BUDGETED),
                    max_claims_per_window=WINDOW_LIMIT,
                    window=admission_pb2.Window(
                        period=admission_pb2.WINDOW_PERIOD_HOUR, time_zone="UTC", start="00:00"
                    ),
                )
            ),
            metadata=tenant.human,
        )
        w = World(
            client=client,
            db=db,
            # Valid tokens first: hypothesis draws early entries more often.
            tokens={
                "agent": tenant.agent,
                "human": tenant.human,
                "full": auth(full_token),
                "operator": auth(OPERATOR_TOKEN),
                "other-human": other.human,
                "other-agent": other.agent,
                "bad": auth("sbe_not-a-token"),
                "none": (),
            },
            hook_tokens={
                "hook-human": hooked.human,
                "human": tenant.human,
                "operator": auth(OPERATOR_TOKEN),
                "bad": auth("sbe_not-a-token"),
            },
            endpoint_ids=[tenant.endpoint_id, full_id, other.endpoint_id],
            owner_ids=[tenant.owner_id, other.owner_id],
            revocable=[victim.credential.id],
            hook_endpoint_id=hooked.endpoint_id,
        )
        for i in range(30):
            name = BUDGETED if i % 2 else "work"
            w.harvest(
                await client.dispatch.Ingest(
                    dispatch_pb2.IngestRequest(
                        queue=queue_pb2.QueueRef(name=name), payload=b"%d" % i, max_attempts=2
                    ),
                    metadata=tenant.agent,
                )
            )
        for name in ("work", BUDGETED):
            w.harvest(
                await client.dispatch.ClaimNext(
                    dispatch_pb2.ClaimNextRequest(queues=[name], max_todos=5),
                    metadata=tenant.agent,
                )
            )
        assert len(w.leases) == 10
        w.harvest(
            await client.schedules.CreateSchedule(
                schedule_pb2.CreateScheduleRequest(
                    schedule=schedule_pb2.Schedule(
                        queue=queue_pb2.QueueRef(name="scheduled"),
                        name="nightly",
                        template=schedule_pb2.TodoTemplate(payload=b"{}"),
                        recurrence=schedule_pb2.Recurrence(time_zone="UTC", cron="0 3 * * *"),
                    )
                ),
                metadata=auth(full_token),
            )
        )
        yield w
    finally:
        await db.close()
        await client.close()


# --- strategies ----------------------------------------------------------------

#: Characters worth trying in any string: NUL, C0/C1 controls, separators,
#: bidi and BOM format characters, noncharacters, the last code point, and
#: the punctuation that names and paths care about.
NASTY = [
    "\x00",
    "\x01",
    "\t",
    "\n",
    "\r",
    "\x1b",
    "\x7f",
    "\x85",
    "\x9f",
    "\u00a0",
    "\u2028",
    "\u2029",
    "\u200f",
    "\u202e",
    "\ufeff",
    "\ufdd0",
    "\ufffd",
    "\ufffe",
    "\uffff",
    "\U0001fffe",
    "\U0010ffff",
    "é",
    "夜",
    "🙂",
    " ",
    "%",
    "'",
    '"',
    "\\",
    "/",
    ":",
    "-",
    "_",
    ".",
]
#: Lengths around every bound the server has, and far past them.
LENGTHS = [19, 20, 63, 64, 65, 100, 101, 200, 201, 255, 256, 2048, 2049, 4096, 4097, 5000, 70_000]
#: Every Unicode scalar value protobuf strings can carry (surrogates cannot
#: be put in a Python protobuf string; the raw-bytes test sends them).
CHARS = st.characters(codec="utf-8")


def texts(*samples: str) -> st.SearchStrategy[str]:
    """Strings: two times in three one of ``samples`` (plausible values, so
    that calls get past validation), else empty or NUL-bearing, random text, long
    runs, or a sample with one nasty character spliced in."""
    base = list(samples) or ["x"]
    wild = st.one_of(
        st.sampled_from(["", " ", "\x00", "a\x00b"]),
        st.text(st.one_of(st.sampled_from(NASTY), CHARS), max_size=30),
        st.builds(
            lambda unit, n: (unit * n)[:n],
            st.sampled_from(["a", "9", "\x00", "é", "🙂", "a\x00", "\U0010ffff"]),
            st.sampled_from(LENGTHS),
        ),
        st.builds(
            lambda s, c, i: s[:i] + c + s[i:],
            st.sampled_from(base),
            st.sampled_from(NASTY),
            st.integers(0, 40),
        ),
    )
    plausible = st.sampled_from(base)
    return st.one_of(plausible, plausible, wild)


INT32 = st.one_of(
    st.sampled_from([0, 1, -1, 2, 5, 100, 101, 500, 501, 2**31 - 1, -(2**31)]),
    st.integers(-(2**31), 2**31 - 1),
)
INT64 = st.one_of(
    st.sampled_from(
        [0, 1, -1, 86_400, 86_401, 365 * 86_400 + 1, 315_576_000_001, 2**63 - 1, -(2**63)]
    ),
    st.integers(-(2**63), 2**63 - 1),
)
NANOS = st.one_of(
    st.sampled_from([0, 1, -1, 999_999_999, 1_000_000_000, -999_999_999, 2**31 - 1, -(2**31)]),
    st.integers(-(2**31), 2**31 - 1),
)
DURATIONS = st.builds(duration_pb2.Duration, seconds=INT64, nanos=NANOS)
TIMESTAMPS = st.builds(timestamp_pb2.Timestamp, seconds=INT64, nanos=NANOS)
PAYLOADS = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"\x00" * 1024, b"x" * (1024 * 1024), b"x" * (1024 * 1024 + 1)]),
)
QUEUE_NAMES = texts("work", BUDGETED, "a" * 64, "9a_b.c:d-e", "-x")
#: Names a policy call may use: never the budgeted queue.
POLICY_QUEUE_NAMES = texts("work", "other", "a" * 64, "p.q").filter(lambda s: s != BUDGETED)
VALID_ZONES = ["UTC", "Europe/Paris", "Pacific/Kiritimati", "Asia/Kathmandu", "Australia/Lord_Howe"]
VALID_STARTS = ["00:00", "23:59", "09:30", "02:30"]
ZONES = texts(*VALID_ZONES)
STARTS = texts(*VALID_STARTS, "24:00", "9:00")


def enums(highest: int) -> st.SearchStrategy[int]:
    """Known values of an enum and unknown ones (open enums keep any int32)."""
    return st.one_of(st.integers(0, highest), st.sampled_from([-1, highest + 1, 99, 2**31 - 1]))


def many(element: st.SearchStrategy[Any], pool: list[Any]) -> st.SearchStrategy[list[Any]]:
    """A repeated field: a few random items, duplicates, or far too many."""
    return st.one_of(
        st.lists(element, max_size=4),
        st.lists(st.sampled_from(pool), min_size=2, max_size=6),
        st.builds(lambda item, n: [item] * n, st.sampled_from(pool), st.sampled_from([101, 501])),
    )


def message(
    cls: type[Message], optional: dict[str, st.SearchStrategy[Any]], **required: Any
) -> st.SearchStrategy[Any]:
    """Messages of ``cls``; fields in ``optional`` are sometimes left unset."""
    return st.fixed_dictionaries(required, optional=optional).map(lambda d: cls(**d))


def ids(pool: list[str]) -> st.SearchStrategy[str]:
    """An id field: a real one, a random UUID, or anything."""
    return st.one_of(
        st.sampled_from(pool) if pool else st.nothing(),
        st.uuids().map(str),
        st.uuids().map(lambda u: "{" + str(u) + "}"),
        st.uuids().map(lambda u: "urn:uuid:" + str(u)),
        texts("00000000-0000-0000-0000-000000000000", "0" * 32),
    )


def todo_ids(w: World) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(w.todo_ids),
        texts("1", "0", "-1", str(2**63 - 1), str(2**63), "9" * 5000, "١٢", "1_0"),
    )


def lease_pair(w: World) -> st.SearchStrategy[tuple[str, str]]:
    """(todo id, lease id): a real pair (often already settled), or spoiled ones."""
    return st.one_of(
        st.sampled_from(w.leases),
        st.tuples(todo_ids(w), ids([lease for _, lease in w.leases])),
    )


def queue_ref(w: World, names: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return message(queue_pb2.QueueRef, {"endpoint_id": ids(w.endpoint_ids)}, name=names)


def window() -> st.SearchStrategy[Any]:
    return message(
        admission_pb2.Window,
        {"period": enums(3), "time_zone": ZONES, "start": STARTS, "weekday": enums(7)},
    )


def valid_policy(w: World) -> st.SearchStrategy[Any]:
    """A policy the server accepts, for a queue of the tenant (never the budgeted one)."""
    windows = st.one_of(
        st.builds(
            lambda period, zone, start: admission_pb2.Window(
                period=period, time_zone=zone, start=start
            ),
            st.sampled_from([admission_pb2.WINDOW_PERIOD_HOUR, admission_pb2.WINDOW_PERIOD_DAY]),
            st.sampled_from(VALID_ZONES),
            st.sampled_from(VALID_STARTS),
        ),
        st.builds(
            lambda zone, start, day: admission_pb2.Window(
                period=admission_pb2.WINDOW_PERIOD_WEEK, time_zone=zone, start=start, weekday=day
            ),
            st.sampled_from(VALID_ZONES),
            st.sampled_from(VALID_STARTS),
            st.integers(1, 7),
        ),
    )
    limits = st.one_of(
        st.fixed_dictionaries({"max_in_flight": st.sampled_from([0, 1, 5, 10_000])}),
        st.fixed_dictionaries(
            {"max_claims_per_window": st.sampled_from([0, 1, 10]), "window": windows},
            optional={"max_in_flight": st.sampled_from([0, 3])},
        ),
    )
    return st.builds(
        lambda name, more: admission_pb2.AdmissionPolicy(
            queue=queue_pb2.QueueRef(endpoint_id=w.endpoint_ids[0], name=name), **more
        ),
        st.sampled_from(["work", "other", "p.q"]),
        limits,
    )


def policy(w: World) -> st.SearchStrategy[Any]:
    return st.one_of(valid_policy(w), wild_policy(w))


def wild_policy(w: World) -> st.SearchStrategy[Any]:
    return message(
        admission_pb2.AdmissionPolicy,
        {
            "queue": queue_ref(w, POLICY_QUEUE_NAMES),
            "max_in_flight": INT32,
            "max_claims_per_window": INT32,
            "window": window(),
            "updated_at": TIMESTAMPS,
        },
    )


#: Template patterns: matching none of the queues the other calls use (the
#: budgeted one keeps its own policy either way), and malformed ones.
TEMPLATE_PATTERNS = texts("tpl:*", "tpl:a:*", "t*", "tpl", "a*b*", "-x*", "a" * 65 + "*")


def policy_template(w: World) -> st.SearchStrategy[Any]:
    return message(
        admission_pb2.PolicyTemplate,
        {
            "endpoint_id": ids(w.endpoint_ids),
            "pattern": TEMPLATE_PATTERNS,
            "max_in_flight": INT32,
            "max_claims_per_window": INT32,
            "window": window(),
            "updated_at": TIMESTAMPS,
        },
    )


def settlement(w: World) -> st.SearchStrategy[Any]:
    action: st.SearchStrategy[dict[str, Message]] = st.one_of(
        st.just({}),
        st.just({"complete": dispatch_pb2.CompleteAction()}),
        st.builds(lambda r: {"complete": dispatch_pb2.CompleteAction(result=r)}, result()),
        st.just({"release": dispatch_pb2.ReleaseAction()}),
        st.builds(
            lambda error, permanent: {
                "fail": dispatch_pb2.FailAction(error=error, permanent=permanent)
            },
            texts("boom", "Traceback\n  line 1\n\tValueError"),
            st.booleans(),
        ),
    )
    return st.builds(
        lambda pair, act: dispatch_pb2.Settlement(todo_id=pair[0], lease_id=pair[1], **act),
        lease_pair(w),
        action,
    )


RESULTS = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"r" * (64 * 1024), b"r" * (64 * 1024 + 1), b"x" * (1024 * 1024)]),
)


def result() -> st.SearchStrategy[Any]:
    """A completion's result: small, at the 64 KiB limit, just over it, or far over."""
    return message(
        todo_pb2.TodoResult, {"data": RESULTS, "content_type": texts("application/json")}
    )


def dedup_key() -> st.SearchStrategy[Any]:
    return message(
        todo_pb2.DedupKey, {"webhook_id": texts("gh"), "delivery_id": texts("d-1", "d-2")}
    )


def todo_filter(w: World) -> st.SearchStrategy[Any]:
    """A bulk action's filter: often valid (an endpoint, states), often not."""
    return message(
        dispatch_pb2.TodoFilter,
        {
            "endpoint_id": ids(w.endpoint_ids),
            "queues": many(QUEUE_NAMES, ["work", BUDGETED]),
            "states": many(enums(5), [1, 2, 4, 5]),
            "created_before": TIMESTAMPS,
            "created_after": TIMESTAMPS,
            "error_contains": texts("boom", "%", "x" * 201),
        },
    )


def lease_ref(w: World) -> st.SearchStrategy[Any]:
    return lease_pair(w).map(lambda p: dispatch_pb2.LeaseRef(todo_id=p[0], lease_id=p[1]))


def lease_call(cls: Callable[..., Message], w: World, **extra: st.SearchStrategy[Any]) -> Any:
    """A request naming one todo and its lease, plus ``extra`` optional fields.

    (``cls`` as a callable: the stubs' ``Message`` takes no field keywords,
    each generated message class does.)
    """
    return st.builds(
        lambda pair, more: cls(todo_id=pair[0], lease_id=pair[1], **more),
        lease_pair(w),
        st.fixed_dictionaries({}, optional=extra),
    )


def hook_url() -> st.SearchStrategy[str]:
    """Notify hook URLs; the valid ones name loopback only."""
    return st.one_of(
        texts(
            "http://127.0.0.1:9/hook",
            "http://[::1/hook",
            "http://127.0.0.1:99999/hook",
            "http://a\uff03b@127.0.0.1/hook",
            "http://[::1]:9/ü",
            "ftp://127.0.0.1/hook",
            "http://127.0.0.1:9/a b",
            "http:///hook",
        ),
        st.builds(
            lambda host, path: f"http://{host}/{path}",
            st.sampled_from(["127.0.0.1:9", "[::1]:9", "[::1", "127.0.0.1:99999", "127.0.0.1:x"]),
            texts("hook", "a b", "ü"),
        ),
    )


#: Cron expressions: valid ones, ones that never fire (31 February), and wrong ones.
CRONS = texts(
    "*/5 * * * *",
    "0 9 * * 1-5",
    "30 2 * * *",
    "0 0 29 2 *",
    "0 0 31 2 *",
    "61 * * * *",
    "* * * *",
    "@hourly",
    "0 0 * * 8",
)


def valid_recurrence() -> st.SearchStrategy[Any]:
    """A recurrence the server accepts: a calendar rule or a cron expression."""
    zones = st.sampled_from(VALID_ZONES)
    return st.one_of(
        st.builds(
            lambda zone, cron: schedule_pb2.Recurrence(time_zone=zone, cron=cron),
            zones,
            st.sampled_from(["*/5 * * * *", "0 9 * * 1-5", "30 2 * * *", "0 0 29 2 *"]),
        ),
        st.builds(
            lambda zone, at: schedule_pb2.Recurrence(
                time_zone=zone,
                calendar=schedule_pb2.CalendarRecurrence(
                    period=admission_pb2.WINDOW_PERIOD_DAY, at=at
                ),
            ),
            zones,
            st.sampled_from(VALID_STARTS),
        ),
        st.builds(
            lambda zone, at, day: schedule_pb2.Recurrence(
                time_zone=zone,
                calendar=schedule_pb2.CalendarRecurrence(
                    period=admission_pb2.WINDOW_PERIOD_WEEK, at=at, weekday=day
                ),
            ),
            zones,
            st.sampled_from(VALID_STARTS),
            st.integers(1, 7),
        ),
    )


def recurrence() -> st.SearchStrategy[Any]:
    """A recurrence: often valid, else any calendar rule or cron text, or none."""
    calendar = message(
        schedule_pb2.CalendarRecurrence,
        {"period": enums(3), "at": STARTS, "weekday": enums(7)},
    )
    return st.one_of(
        valid_recurrence(),
        message(schedule_pb2.Recurrence, {"time_zone": ZONES}, cron=CRONS),
        message(schedule_pb2.Recurrence, {"time_zone": ZONES}, calendar=calendar),
        message(schedule_pb2.Recurrence, {"time_zone": ZONES}),
    )


def schedule_ids(w: World) -> st.SearchStrategy[str]:
    return st.one_of(ids(w.schedule_ids), texts("sch_1", "0" * 32))


def schedule(w: World, *, with_id: bool) -> st.SearchStrategy[Any]:
    """A schedule to create (no id) or update (an id, real or not): often
    plausible in every field, else anything in any field."""
    required: dict[str, st.SearchStrategy[Any]] = {}
    if with_id:
        required["id"] = schedule_ids(w)
    plausible = message(
        schedule_pb2.Schedule,
        {"catch_up": st.integers(0, 2)},
        **required,
        queue=st.builds(
            lambda endpoint, name: queue_pb2.QueueRef(endpoint_id=endpoint, name=name),
            st.sampled_from([w.endpoint_ids[0], ""]),
            st.sampled_from(["work", "scheduled", BUDGETED]),
        ),
        name=st.integers(0, 10**9).map(lambda i: f"every-{i}"),
        template=st.builds(schedule_pb2.TodoTemplate, payload=st.binary(max_size=32)),
        recurrence=valid_recurrence(),
    )
    wild = message(
        schedule_pb2.Schedule,
        {
            "queue": queue_ref(w, QUEUE_NAMES),
            "name": texts("nightly", "hourly-report"),
            "template": message(
                schedule_pb2.TodoTemplate,
                {
                    "payload": PAYLOADS,
                    "content_type": texts("application/json"),
                    "max_attempts": INT32,
                },
            ),
            "recurrence": recurrence(),
            "catch_up": enums(2),
            "paused": st.booleans(),
            "next_slot": TIMESTAMPS,
            "todos_created": INT64,
        },
        **required,
    )
    return st.one_of(plausible, wild)


def schedule_by_id(cls: type[Message], w: World) -> st.SearchStrategy[Any]:
    return message(cls, {"id": schedule_ids(w)})


# Each RPC: how to call it, and its requests.
Stub = Callable[[Client], Callable[..., Any]]
RPCS: dict[str, tuple[Stub, Callable[[World], st.SearchStrategy[Any]]]] = {
    "Ingest": (
        lambda c: c.dispatch.Ingest,
        lambda w: message(
            dispatch_pb2.IngestRequest,
            {
                "queue": queue_ref(w, QUEUE_NAMES),
                "payload": PAYLOADS,
                "content_type": texts("application/json", "text/plain; charset=utf-8"),
                "dedup": dedup_key(),
                "max_attempts": INT32,
                "delay": DURATIONS,
                "idempotency_key": texts("key-1", "k" * 201),
                "idempotency_retention": DURATIONS,
                "priority": INT32,
            },
        ),
    ),
    "IngestTodos": (
        lambda c: c.dispatch.IngestTodos,
        lambda w: message(
            dispatch_pb2.IngestTodosRequest,
            {"endpoint_id": ids(w.endpoint_ids)},
            todos=st.lists(
                message(
                    dispatch_pb2.IngestRequest,
                    {
                        "queue": queue_ref(w, QUEUE_NAMES),
                        "payload": PAYLOADS,
                        "idempotency_key": texts("key-2"),
                        "priority": INT32,
                    },
                ),
                max_size=3,
            ),
        ),
    ),
    "Claim": (
        lambda c: c.dispatch.Claim,
        lambda w: message(
            dispatch_pb2.ClaimRequest,
            {"claimant": texts("worker-1"), "lease_duration": DURATIONS},
            todo_id=todo_ids(w),
        ),
    ),
    "ClaimNext": (
        lambda c: c.dispatch.ClaimNext,
        lambda w: message(
            dispatch_pb2.ClaimNextRequest,
            {
                "endpoint_id": ids(w.endpoint_ids),
                "queues": many(QUEUE_NAMES, ["work", BUDGETED]),
                "claimant": texts("worker-1"),
                "lease_duration": DURATIONS,
                "max_todos": INT32,
            },
        ),
    ),
    "Heartbeat": (
        lambda c: c.dispatch.Heartbeat,
        lambda w: lease_call(dispatch_pb2.HeartbeatRequest, w, lease_duration=DURATIONS),
    ),
    "HeartbeatTodos": (
        lambda c: c.dispatch.HeartbeatTodos,
        lambda w: message(
            dispatch_pb2.HeartbeatTodosRequest,
            {
                "leases": many(
                    lease_ref(w),
                    [dispatch_pb2.LeaseRef(todo_id=t, lease_id=x) for t, x in w.leases],
                ),
                "lease_duration": DURATIONS,
            },
        ),
    ),
    "Complete": (
        lambda c: c.dispatch.Complete,
        lambda w: lease_call(dispatch_pb2.CompleteRequest, w, result=result()),
    ),
    "Fail": (
        lambda c: c.dispatch.Fail,
        lambda w: lease_call(
            dispatch_pb2.FailRequest,
            w,
            error=texts("boom", "Traceback\n  line 1\n\tValueError"),
            permanent=st.booleans(),
        ),
    ),
    "Release": (lambda c: c.dispatch.Release, lambda w: lease_call(dispatch_pb2.ReleaseRequest, w)),
    "SettleTodos": (
        lambda c: c.dispatch.SettleTodos,
        lambda w: message(
            dispatch_pb2.SettleTodosRequest,
            {
                "settlements": many(
                    settlement(w),
                    [
                        dispatch_pb2.Settlement(
                            todo_id=t, lease_id=x, complete=dispatch_pb2.CompleteAction()
                        )
                        for t, x in w.leases
                    ],
                )
            },
        ),
    ),
    "GetTodo": (
        lambda c: c.dispatch.GetTodo,
        lambda w: message(
            dispatch_pb2.GetTodoRequest,
            {"todo_id": todo_ids(w), "dedup": dedup_key(), "endpoint_id": ids(w.endpoint_ids)},
        ),
    ),
    "ListTodos": (
        lambda c: c.dispatch.ListTodos,
        lambda w: message(
            dispatch_pb2.ListTodosRequest,
            {
                "endpoint_id": ids(w.endpoint_ids),
                "queues": many(QUEUE_NAMES, ["work", BUDGETED]),
                "states": many(enums(5), [1, 2, 5]),
                "page_size": INT32,
                "page_token": texts("djE6NQ", "djE6OTk5OTk5OTk5OTk5OTk5OTk5OTk5", "v1:5"),
                "dedup": dedup_key(),
                "error_contains": texts("boom", "%", "_", "\\", "é" * 200, "x" * 201),
            },
        ),
    ),
    "CancelTodo": (
        lambda c: c.dispatch.CancelTodo,
        lambda w: message(dispatch_pb2.CancelTodoRequest, {"todo_id": todo_ids(w)}),
    ),
    "RequeueTodo": (
        lambda c: c.dispatch.RequeueTodo,
        lambda w: message(
            dispatch_pb2.RequeueTodoRequest,
            {"delay": DURATIONS, "max_attempts": INT32},
            todo_id=todo_ids(w),
        ),
    ),
    "CancelTodos": (
        lambda c: c.dispatch.CancelTodos,
        lambda w: message(
            dispatch_pb2.CancelTodosRequest,
            {
                "todo_ids": many(todo_ids(w), w.todo_ids),
                "filter": todo_filter(w),
                "dry_run": st.booleans(),
                "page_token": texts("djE6NQ", "v1:5"),
            },
        ),
    ),
    "RequeueTodos": (
        lambda c: c.dispatch.RequeueTodos,
        lambda w: message(
            dispatch_pb2.RequeueTodosRequest,
            {
                "todo_ids": many(todo_ids(w), w.todo_ids),
                "filter": todo_filter(w),
                "dry_run": st.booleans(),
                "page_token": texts("djE6NQ", "v1:5"),
                "delay": DURATIONS,
                "max_attempts": INT32,
            },
        ),
    ),
    "ListTodoAudit": (
        lambda c: c.dispatch.ListTodoAudit,
        lambda w: message(
            dispatch_pb2.ListTodoAuditRequest,
            {
                "endpoint_id": ids(w.endpoint_ids),
                "page_size": INT32,
                "page_token": texts("djE6NQ", "v1:5"),
            },
        ),
    ),
    "WhoAmI": (lambda c: c.admin.WhoAmI, lambda w: st.just(admin_pb2.WhoAmIRequest())),
    "CreateOwner": (
        lambda c: c.admin.CreateOwner,
        lambda w: message(admin_pb2.CreateOwnerRequest, {"name": texts("acme", "fresh")}),
    ),
    "ListOwners": (lambda c: c.admin.ListOwners, lambda w: st.just(admin_pb2.ListOwnersRequest())),
    "CreateHuman": (
        lambda c: c.admin.CreateHuman,
        lambda w: message(
            admin_pb2.CreateHumanRequest,
            {"owner_id": ids(w.owner_ids), "name": texts("ann", "acme-human")},
        ),
    ),
    "CreateEndpoint": (
        lambda c: c.admin.CreateEndpoint,
        lambda w: message(admin_pb2.CreateEndpointRequest, {"name": texts("agent", "bot")}),
    ),
    "ListEndpoints": (
        lambda c: c.admin.ListEndpoints,
        lambda w: st.just(admin_pb2.ListEndpointsRequest()),
    ),
    "VendCredential": (
        lambda c: c.admin.VendCredential,
        lambda w: message(
            admin_pb2.VendCredentialRequest,
            {
                "endpoint_id": ids(w.endpoint_ids),
                "grants": many(enums(7), [1, 4, 6, 7]),
                "presets": many(enums(1), [1]),
                "label": texts("ci", "nightly"),
            },
        ),
    ),
    "ListCredentials": (
        lambda c: c.admin.ListCredentials,
        lambda w: message(admin_pb2.ListCredentialsRequest, {"endpoint_id": ids(w.endpoint_ids)}),
    ),
    "RevokeCredential": (
        lambda c: c.admin.RevokeCredential,
        lambda w: message(admin_pb2.RevokeCredentialRequest, {"credential_id": ids(w.revocable)}),
    ),
    "SetNotifyHook": (
        lambda c: c.admin.SetNotifyHook,
        lambda w: message(
            admin_pb2.SetNotifyHookRequest,
            {"endpoint_id": ids([w.hook_endpoint_id]), "url": hook_url()},
        ),
    ),
    "ClearNotifyHook": (
        lambda c: c.admin.ClearNotifyHook,
        lambda w: message(
            admin_pb2.ClearNotifyHookRequest, {"endpoint_id": ids([w.hook_endpoint_id])}
        ),
    ),
    "GetPolicy": (
        lambda c: c.admission.GetPolicy,
        lambda w: message(admission_pb2.GetPolicyRequest, {"queue": queue_ref(w, QUEUE_NAMES)}),
    ),
    "SetPolicy": (
        lambda c: c.admission.SetPolicy,
        lambda w: message(admission_pb2.SetPolicyRequest, {"policy": policy(w)}),
    ),
    "ClearPolicy": (
        lambda c: c.admission.ClearPolicy,
        lambda w: message(
            admission_pb2.ClearPolicyRequest, {"queue": queue_ref(w, POLICY_QUEUE_NAMES)}
        ),
    ),
    "ListPolicyAudit": (
        lambda c: c.admission.ListPolicyAudit,
        lambda w: message(
            admission_pb2.ListPolicyAuditRequest,
            {
                "queue": queue_ref(w, QUEUE_NAMES),
                "page_size": INT32,
                "page_token": texts("djE6NQ", "v1:5"),
            },
        ),
    ),
    "SetPolicyTemplate": (
        lambda c: c.admission.SetPolicyTemplate,
        lambda w: message(
            admission_pb2.SetPolicyTemplateRequest, {"policy_template": policy_template(w)}
        ),
    ),
    "GetPolicyTemplate": (
        lambda c: c.admission.GetPolicyTemplate,
        lambda w: message(
            admission_pb2.GetPolicyTemplateRequest,
            {"endpoint_id": ids(w.endpoint_ids), "pattern": TEMPLATE_PATTERNS},
        ),
    ),
    "ClearPolicyTemplate": (
        lambda c: c.admission.ClearPolicyTemplate,
        lambda w: message(
            admission_pb2.ClearPolicyTemplateRequest,
            {"endpoint_id": ids(w.endpoint_ids), "pattern": TEMPLATE_PATTERNS},
        ),
    ),
    "ListPolicyTemplates": (
        lambda c: c.admission.ListPolicyTemplates,
        lambda w: message(
            admission_pb2.ListPolicyTemplatesRequest, {"endpoint_id": ids(w.endpoint_ids)}
        ),
    ),
    "ListPolicyTemplateAudit": (
        lambda c: c.admission.ListPolicyTemplateAudit,
        lambda w: message(
            admission_pb2.ListPolicyTemplateAuditRequest,
            {
                "endpoint_id": ids(w.endpoint_ids),
                "pattern": TEMPLATE_PATTERNS,
                "page_size": INT32,
                "page_token": texts("djE6NQ", "v1:5"),
            },
        ),
    ),
    "CreateSchedule": (
        lambda c: c.schedules.CreateSchedule,
        lambda w: message(
            schedule_pb2.CreateScheduleRequest, {"schedule": schedule(w, with_id=False)}
        ),
    ),
    "GetSchedule": (
        lambda c: c.schedules.GetSchedule,
        lambda w: schedule_by_id(schedule_pb2.GetScheduleRequest, w),
    ),
    "ListSchedules": (
        lambda c: c.schedules.ListSchedules,
        lambda w: message(
            schedule_pb2.ListSchedulesRequest,
            {
                "endpoint_id": ids(w.endpoint_ids),
                "page_size": INT32,
                "page_token": texts("djE6NQ", "v1:5"),
            },
        ),
    ),
    "UpdateSchedule": (
        lambda c: c.schedules.UpdateSchedule,
        lambda w: message(
            schedule_pb2.UpdateScheduleRequest, {"schedule": schedule(w, with_id=True)}
        ),
    ),
    "PauseSchedule": (
        lambda c: c.schedules.PauseSchedule,
        lambda w: schedule_by_id(schedule_pb2.PauseScheduleRequest, w),
    ),
    "ResumeSchedule": (
        lambda c: c.schedules.ResumeSchedule,
        lambda w: schedule_by_id(schedule_pb2.ResumeScheduleRequest, w),
    ),
    "DeleteSchedule": (
        lambda c: c.schedules.DeleteSchedule,
        lambda w: schedule_by_id(schedule_pb2.DeleteScheduleRequest, w),
    ),
    "ListScheduleAudit": (
        lambda c: c.schedules.ListScheduleAudit,
        lambda w: message(
            schedule_pb2.ListScheduleAuditRequest,
            {
                "schedule_id": schedule_ids(w),
                "page_size": INT32,
                "page_token": texts("djE6NQ", "v1:5"),
            },
        ),
    ),
}

HOOK_RPCS = {"SetNotifyHook", "ClearNotifyHook"}


def _check_error(err: grpc.aio.AioRpcError, request: MessageDescriptor, context: object) -> None:
    """An allowed code, answered by the server with its rich status: not, say,
    an error message too large for the client's metadata limit (which the
    client reports as RESOURCE_EXHAUSTED without the server's details). The
    one answer without details is gRPC's own to a request over the server's
    message size limit. Each field a violation names is a field of the
    request message (``todos[3].queue.endpoint_id``), not another one's."""
    assert err.code() in ALLOWED, (err.code(), err.details(), context)
    if (err.details() or "").startswith("SERVER: Received message larger than max"):
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, context
        return
    status = rich_status(err)
    assert status.code == err.code().value[0], (status, context)
    for path in field_violations(err):
        assert field_path_resolves(request, path), (path, request.full_name, context)


def _cut(value: object) -> str:
    text = repr(value)
    return text if len(text) < 1500 else text[:1500] + "..."


async def _ensure_healthy(w: World) -> None:
    """The server serves: health is SERVING, and a normal ingest and ClaimNext work."""
    health = health_pb2_grpc.HealthStub(w.client.channel)
    answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    agent = w.tokens["agent"]
    await w.client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name=AFTER), payload=b"ok"),
        metadata=agent,
        timeout=10,
    )
    claimed = await w.client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=[AFTER]), metadata=agent, timeout=10
    )
    assert claimed.todo.queue.name == AFTER
    await w.client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=claimed.todo.id, lease_id=claimed.lease.lease_id),
        metadata=agent,
        timeout=10,
    )


async def _check_invariants(w: World) -> None:
    async with w.db.connection() as conn:
        leaseless = await conn.fetchval(
            "SELECT count(*) FROM todos WHERE state = 'claimed'"
            " AND (lease_id IS NULL OR lease_expires_at IS NULL)"
        )
        assert leaseless == 0, "a claimed todo without a lease"
        over = await conn.fetchval("SELECT count(*) FROM todos WHERE attempt > max_attempts")
        assert over == 0, "a todo with more attempts than max_attempts"
        # The budgeted queue's policy never changed, so each window's charged
        # units are exactly the attempts claimed in it, and no window holds
        # more than the limit.
        rows = await conn.fetch(
            """
            SELECT c.window_start, c.units,
                   (SELECT count(*) FROM all_attempts a
                     WHERE a.endpoint_id = p.endpoint_id AND a.queue_id = p.queue_id
                       AND a.claimed_at >= c.window_start
                       AND a.claimed_at < (SELECT min(b) FROM unnest(p.window_bounds) b
                                            WHERE b > c.window_start)) AS attempts
              FROM window_counters c
              JOIN admission_policies p ON p.endpoint_id = c.endpoint_id AND p.id = c.policy_id
              JOIN queues q ON q.endpoint_id = p.endpoint_id AND q.id = p.queue_id
             WHERE q.endpoint_id = $1 AND q.name = $2
            """,
            uuid.UUID(w.endpoint_ids[0]),
            BUDGETED,
        )
        for row in rows:
            assert row["units"] == row["attempts"], dict(row)
            assert row["units"] <= WINDOW_LIMIT, dict(row)
        charged = sum(row["units"] for row in rows)
        attempts = await conn.fetchval(
            "SELECT count(*) FROM all_attempts a"
            " JOIN queues q ON q.endpoint_id = a.endpoint_id AND q.id = a.queue_id"
            " WHERE q.endpoint_id = $1 AND q.name = $2",
            uuid.UUID(w.endpoint_ids[0]),
            BUDGETED,
        )
        assert charged == attempts
        assert charged > 0, "the budgeted queue was claimed from"


@pytest.fixture
async def still_serving(world: World) -> AsyncIterator[None]:
    """After each RPC's run: the server serves and the invariants hold."""
    yield
    await _ensure_healthy(world)
    await _check_invariants(world)


async def _call_and_check(
    w: World, rpc: str, method: Callable[..., Any], request: Message, token: str
) -> None:
    metadata = (w.hook_tokens if rpc in HOOK_RPCS else w.tokens)[token]
    try:
        response = await method(request, metadata=metadata, timeout=60)
    except grpc.aio.AioRpcError as err:
        _check_error(err, request.DESCRIPTOR, (rpc, token, _cut(request)))
        return
    w.harvest(response)


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("rpc", [name for name in RPCS])
@FUZZ_SETTINGS
@given(data=st.data())
async def test_fuzzed_requests_never_answer_internal(
    world: World, rpc: str, data: st.DataObject
) -> None:
    stub, requests = RPCS[rpc]
    request = data.draw(requests(world), label="request")
    tokens = world.hook_tokens if rpc in HOOK_RPCS else world.tokens
    token = data.draw(st.sampled_from(list(tokens)), label="token")
    await _call_and_check(world, rpc, stub(world.client), request, token)


@pytest.mark.usefixtures("still_serving")
@FUZZ_SETTINGS
@given(data=st.data())
async def test_fuzzed_watch_reopen_never_answers_internal(
    world: World, data: st.DataObject
) -> None:
    endpoint_ids = st.one_of(ids(world.endpoint_ids), st.just(""))
    request = data.draw(
        message(
            dispatch_pb2.WatchReopenRequest,
            {"endpoint_id": endpoint_ids, "queues": many(QUEUE_NAMES, ["work", BUDGETED])},
        ),
        label="request",
    )
    token = data.draw(st.sampled_from(list(world.tokens)), label="token")
    call = world.client.dispatch.WatchReopen(request, metadata=world.tokens[token])
    try:
        # The first doorbell, the end of the call, or a quiet subscription.
        await asyncio.wait_for(call.read(), timeout=0.2)
    except TimeoutError:
        pass
    except grpc.aio.AioRpcError as err:
        _check_error(err, request.DESCRIPTOR, (token, _cut(request)))
    finally:
        call.cancel()
    if call.done() and not call.cancelled():
        code = await call.code()
        assert code in ALLOWED, (token, code, await call.details(), _cut(request))


# --- raw bytes -------------------------------------------------------------------

SERVICES = [
    dispatch_pb2.DESCRIPTOR.services_by_name["DispatchService"],
    admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"],
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"],
    schedule_pb2.DESCRIPTOR.services_by_name["ScheduleService"],
]
METHODS = [(f"/{s.full_name}/{m.name}", m) for s in SERVICES for m in s.methods]

#: Byte strings that are not UTF-8: a broken two-byte sequence, encoded
#: surrogates (CESU-8), a code point past U+10FFFF, an overlong NUL, stray bytes.
BAD_UTF8 = [
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xed\xbf\xbf",
    b"\xf4\x90\x80\x80",
    b"\xc0\x80",
    b"\xff",
]
#: Not a message of any type: truncated varints and lengths, a group never
#: closed, an invalid wire type, an 11-byte varint.
GARBAGE = [b"\xff\xff\xff\xff", b"\x08", b"\x0a\x05ab", b"\x0b", b"\x0f", b"\x80" * 11 + b"\x01"]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(number: int, body: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def bad_utf8_messages(message_type: descriptor.Descriptor, depth: int = 3) -> list[bytes]:
    """For each string field (also inside message fields), a message with that
    field holding each invalid UTF-8 sequence."""
    found: list[bytes] = []
    for f in message_type.fields:
        if f.type == descriptor.FieldDescriptor.TYPE_STRING:
            found.extend(_length_delimited(f.number, b"ok" + bad) for bad in BAD_UTF8)
        elif f.type == descriptor.FieldDescriptor.TYPE_MESSAGE and f.message_type and depth > 1:
            found.extend(
                _length_delimited(f.number, inner)
                for inner in bad_utf8_messages(f.message_type, depth - 1)
            )
    return found


async def _raw_call(
    w: World, path: str, method: descriptor.MethodDescriptor, body: bytes, metadata: Metadata
) -> grpc.StatusCode:
    """Sends ``body`` as the request; the code of the answer (OK for a stream
    still open after a moment), which must be an allowed one with the
    server's rich status."""
    try:
        if method.server_streaming:
            stream = w.client.channel.unary_stream(path, None, None)(
                body, metadata=metadata, timeout=30
            )
            try:
                await asyncio.wait_for(stream.read(), timeout=0.2)
            except TimeoutError:
                pass
            finally:
                stream.cancel()
        else:
            await w.client.channel.unary_unary(path, None, None)(
                body, metadata=metadata, timeout=30
            )
    except grpc.aio.AioRpcError as err:
        _check_error(err, method.input_type, (path, body[:100]))
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize(("path", "method"), METHODS, ids=[m.name for _, m in METHODS])
async def test_invalid_bytes_are_invalid_argument(
    world: World, path: str, method: descriptor.MethodDescriptor
) -> None:
    bodies = GARBAGE + bad_utf8_messages(method.input_type)
    for body in bodies:
        code = await _raw_call(world, path, method, body, world.tokens["agent"])
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, body, code)
    # Without a valid token the caller learns nothing about its bytes.
    for token in ("bad", "none"):
        code = await _raw_call(world, path, method, GARBAGE[0], world.tokens[token])
        assert code == grpc.StatusCode.UNAUTHENTICATED, (path, token, code)


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize(("path", "method"), METHODS, ids=[m.name for _, m in METHODS])
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(body=st.binary(max_size=200), token=st.sampled_from(["agent", "human", "operator"]))
async def test_random_bytes_never_answer_internal(
    world: World, path: str, method: descriptor.MethodDescriptor, body: bytes, token: str
) -> None:
    if path.endswith(("/SetNotifyHook", "/ClearNotifyHook")):
        token = "human"  # random bytes could spell a URL; the tenant has no hooked endpoint
    code = await _raw_call(world, path, method, body, world.tokens[token])
    assert code in ALLOWED, (path, token, body, code)
