"""The worker contract: every scenario of tests/contract/worker_scenarios.json, run
with the Python worker helper against real server processes.

The file's format is in tests/contract/README.md; the TypeScript worker's tests
run the same file. RPCs are counted on the worker's channel (a client
interceptor), held claims on the servers' ``/metrics``, todos through the API.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import grpc
import httpx
import pytest
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, todo_pb2
from switchboard_dispatch.worker import PermanentFailure, Todo, Worker
from switchboard_server.db import Database

from tests.support.admission import set_policy, window
from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import move_clock
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow

CONTRACT = pathlib.Path(__file__).resolve().parents[1] / "contract" / "worker_scenarios.json"
TABLE: dict[str, Any] = json.loads(CONTRACT.read_text())
SCENARIOS: list[dict[str, Any]] = TABLE["scenarios"]

#: How long a trigger may take when the scenario gives no ``within_ms``.
DEFAULT_WITHIN_MS = 20_000

Json = dict[str, Any]


# --------------------------------------------------------------------------- observing


class CountCalls(
    grpc.aio.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.aio.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Counts every call the worker starts on its channel, by method name."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def _count(self, details: grpc.aio.ClientCallDetails) -> None:
        # The method name is bytes at run time (str in the type stubs).
        method: object = details.method
        name = method.decode() if isinstance(method, bytes) else str(method)
        self.calls[name.rsplit("/", 1)[-1]] += 1

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        self._count(client_call_details)
        return await continuation(client_call_details, request)

    intercept_unary_stream = intercept_unary_unary


@dataclass
class ScriptedHandler:
    """The scenario's handler: what it does per todo, and what it saw."""

    spec: Json
    started: int = 0
    finished: int = 0
    cancelled: int = 0
    running_max: int = 0
    running: dict[str, Todo] = field(default_factory=dict)
    #: The todos whose handlers returned or raised, in order.
    done: list[str] = field(default_factory=list)

    def action(self, todo: Todo) -> str:
        """What to do with ``todo``: by its payload, else by its attempt, else the default."""
        by_payload: Mapping[str, str] = self.spec.get("by_payload", {})
        by_attempt: Mapping[str, str] = self.spec.get("by_attempt", {})
        payload = todo.payload.decode()
        if payload in by_payload:
            return by_payload[payload]
        return by_attempt.get(str(todo.attempt), self.spec["do"])

    def error(self, sentence: str) -> str:
        """A failure's message: ``sentence``, or ``error_chars`` euro signs."""
        chars: int | None = self.spec.get("error_chars")
        return sentence if chars is None else "\u20ac" * chars

    async def __call__(self, todo: Todo) -> None:
        self.started += 1
        self.running[todo.id] = todo
        self.running_max = max(self.running_max, len(self.running))
        try:
            action = self.action(todo)
            await asyncio.sleep(self.spec.get("sleep_ms", 0) / 1000)
            if action == "hang":
                await asyncio.sleep(3600)
            elif action == "fail":
                raise RuntimeError(self.error("the scenario fails this attempt"))
            elif action == "fail_permanently":
                raise PermanentFailure(self.error("the scenario fails this todo for good"))
            else:
                assert action == "complete", action
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except Exception:
            self.finished += 1
            self.done.append(todo.id)
            raise
        else:
            self.finished += 1
            self.done.append(todo.id)
        finally:
            del self.running[todo.id]


@dataclass
class Run:
    """One scenario's servers, tenant, worker and observers."""

    scenario: Json
    servers: list[ServerProcess]
    clients: list[Client]
    tenant: Tenant
    db: Database
    handler: ScriptedHandler
    counter: CountCalls
    worker: Worker | None = None
    task: asyncio.Task[None] | None = None

    async def held_claims(self) -> float:
        """``switchboard_held_claims`` summed over the replicas."""
        total = 0.0
        async with httpx.AsyncClient() as http:
            for server in self.servers:
                text = (await http.get(f"http://{server.http_address}/metrics")).text
                found = re.findall(r"^switchboard_held_claims(?:{.*})? (\S+)$", text, re.M)
                total += sum(float(v) for v in found)
        return total

    async def todos(self) -> list[todo_pb2.Todo]:
        """Every todo of the tenant's endpoint."""
        got: list[todo_pb2.Todo] = []
        token = ""
        while True:
            page = await self.clients[0].dispatch.ListTodos(
                dispatch_pb2.ListTodosRequest(page_size=500, page_token=token),
                metadata=self.tenant.agent,
            )
            got.extend(page.todos)
            token = page.next_page_token
            if not token:
                return got

    def client(self, step: Json) -> Client:
        return self.clients[step.get("replica", 0)]


# --------------------------------------------------------------------------- set-up and events


async def ingest(run: Run, step: Json) -> None:
    for i in range(step.get("count", 1)):
        request = dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(name=step["queue"]), payload=str(i).encode()
        )
        if "max_attempts" in step:
            request.max_attempts = step["max_attempts"]
        await run.client(step).dispatch.Ingest(request, metadata=run.tenant.agent)


async def policy(run: Run, step: Json) -> None:
    assert step.get("window", "day") == "day"
    await set_policy(
        run.client(step),
        run.tenant.human,
        step["queue"],
        endpoint_id=run.tenant.endpoint_id,
        max_in_flight=step.get("max_in_flight"),
        max_claims_per_window=step.get("max_claims_per_window"),
        win=window(),
    )


async def claim(run: Run, step: Json) -> None:
    request = dispatch_pb2.ClaimNextRequest(queues=[step["queue"]], claimant="rival")
    got = await run.client(step).dispatch.ClaimNext(request, metadata=run.tenant.agent)
    if "expect_claimed" in step:
        assert int(not got.empty) == step["expect_claimed"], got


async def cancel_todos(run: Run, step: Json, todo_ids: list[str]) -> None:
    for todo_id in todo_ids:
        await run.client(step).dispatch.CancelTodo(
            dispatch_pb2.CancelTodoRequest(todo_id=todo_id), metadata=run.tenant.human
        )


async def cancel_running(run: Run, step: Json) -> None:
    await cancel_todos(run, step, list(run.handler.running))


async def cancel_finished(run: Run, step: Json) -> None:
    await cancel_todos(run, step, list(run.handler.done))


async def shift_clock(run: Run, step: Json) -> None:
    await move_clock(run.db, timedelta(seconds=step["seconds"]))


async def stop(run: Run, step: Json) -> None:
    assert run.worker is not None and run.task is not None
    run.worker.stop()
    if "returns_within_ms" in step:
        await asyncio.wait_for(asyncio.shield(run.task), step["returns_within_ms"] / 1000)


async def check(run: Run, step: Json) -> None:
    await expect(run, step)


ACTIONS: dict[str, Callable[[Run, Json], Any]] = {
    "ingest": ingest,
    "set_policy": policy,
    "claim": claim,
    "cancel_running": cancel_running,
    "cancel_finished": cancel_finished,
    "move_clock": shift_clock,
    "stop": stop,
    "check": check,
}
SETUP: dict[str, Callable[[Run, Json], Any]] = {"ingest": ingest, "policy": policy, "claim": claim}


async def trigger(run: Run, after: Json) -> None:
    """Waits until every condition of ``after`` holds, then ``then_ms`` more."""
    deadline = time.monotonic() + after.get("within_ms", DEFAULT_WITHIN_MS) / 1000
    while True:
        met = (
            run.handler.started >= after.get("started", 0)
            and run.handler.finished >= after.get("finished", 0)
            and ("held_claims" not in after or await run.held_claims() >= after["held_claims"])
        )
        if met:
            break
        assert run.task is not None
        if run.task.done():
            run.task.result()  # raises what ended the run
            pytest.fail(f"the run ended before {after}")
        assert time.monotonic() < deadline, f"not met in time: {after}"
        await asyncio.sleep(0.05)
    await asyncio.sleep(after.get("then_ms", 0) / 1000)


# --------------------------------------------------------------------------- expectations


def state_name(state: todo_pb2.TodoState.ValueType) -> str:
    """``TODO_STATE_DONE`` as the contract spells it: ``done``."""
    return todo_pb2.TodoState.Name(state).removeprefix("TODO_STATE_").lower()


def within(value: float, bounds: Json, what: str) -> None:
    assert bounds.get("min", value) <= value <= bounds.get("max", value), (what, value, bounds)


async def expect(run: Run, what: Json) -> None:
    """Checks ``todos``, ``attempts``, ``handler``, ``outcomes``, ``rpcs`` and ``held_claims``."""
    if "todos" in what:
        todos = await run.todos()
        states = Counter(
            todo_pb2.TodoState.Name(t.state).removeprefix("TODO_STATE_").lower() for t in todos
        )
        assert dict(states) == {k: v for k, v in what["todos"].items() if v}, states
    if "attempts" in what:
        attempts = [t.attempt for t in await run.todos() if t.attempt > 0]
        assert attempts, "no todo was claimed"
        within(min(attempts), what["attempts"], "attempts (min)")
        within(max(attempts), what["attempts"], "attempts (max)")
    for name, value in what.get("handler", {}).items():
        assert getattr(run.handler, name) == value, (name, getattr(run.handler, name))
    assert run.worker is not None
    for name, value in what.get("outcomes", {}).items():
        assert getattr(run.worker.stats, name) == value, (name, run.worker.stats)
    for method, bounds in what.get("rpcs", {}).items():
        within(run.counter.calls[method], bounds, method)
    if "held_claims" in what:
        deadline = time.monotonic() + 5
        while (held := await run.held_claims()) != what["held_claims"]:
            assert time.monotonic() < deadline, f"held claims: {held}"
            await asyncio.sleep(0.05)


def worker_options(spec: Json) -> dict[str, Any]:
    """The worker spec as ``Worker`` keywords."""
    ms = {
        "lease_ms": "lease",
        "heartbeat_ms": "heartbeat_every",
        "max_idle_wait_ms": "max_idle_wait",
        "shutdown_grace_ms": "shutdown_grace",
        "settle_linger_ms": "settle_linger",
        "rpc_timeout_ms": "rpc_timeout",
    }
    options: dict[str, Any] = {}
    for key, value in spec.items():
        if key in ms:
            options[ms[key]] = timedelta(milliseconds=value)
        else:
            assert key in ("queues", "prefetch", "concurrency", "settle_batch"), key
            options[key] = value
    return options


# --------------------------------------------------------------------------- the runner


@pytest.fixture
async def started(scenario: Json, dsn: str) -> AsyncIterator[list[ServerProcess]]:
    """The scenario's replicas over this test's database."""
    env = {**TABLE["servers"]["env"], **scenario.get("env", {})}
    servers = list(
        await asyncio.gather(
            *(ServerProcess.start(dsn, env) for _ in range(scenario.get("replicas", 1)))
        )
    )
    yield servers
    codes = await asyncio.gather(*(s.stop() for s in servers))
    assert codes == [0] * len(servers), "servers must stop cleanly on SIGTERM"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
async def test_worker_scenario(scenario: Json, started: list[ServerProcess], db: Database) -> None:
    clients = [Client(s.address) for s in started]
    counter = CountCalls()
    channel = grpc.aio.insecure_channel(
        started[0].address, interceptors=[cast(grpc.aio.ClientInterceptor, counter)]
    )
    try:
        tenant = await make_tenant(clients[0], "contract")
        run = Run(
            scenario, started, clients, tenant, db, ScriptedHandler(scenario["handler"]), counter
        )
        for step in scenario["setup"]:
            [(kind, args)] = step.items()
            await SETUP[kind](run, args)
        run.worker = Worker(
            channel,
            tenant.endpoint_token,
            run.handler,
            claimant="contract",
            **worker_options(scenario["worker"]),
        )
        spec = scenario["run"]
        run.task = asyncio.create_task(
            run.worker.run(
                max_todos=spec.get("max_todos"), stop_when_idle=spec.get("until_idle", False)
            )
        )
        try:
            for event in scenario["events"]:
                if "after" in event:
                    await trigger(run, event["after"])
                await ACTIONS[event["do"]](run, event)
            await asyncio.wait_for(asyncio.shield(run.task), spec["within_ms"] / 1000)
        finally:
            if not run.task.done():
                run.worker.stop()
                await asyncio.wait_for(run.task, 10)
        await expect(run, scenario["expect"])
    finally:
        await channel.close(None)
        for c in clients:
            await c.close()
