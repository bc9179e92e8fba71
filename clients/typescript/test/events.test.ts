/**
 * The worker's events against real server processes: `claimed` and `settled` (completed,
 * failed, dead-lettered, lost, cancelled, released), `deferred` on a budgeted queue, no `doorbell` (the
 * worker waits in held claims, not on a doorbell stream) for a new todo, `error` for a refused
 * and for a retried `ClaimNext`, and a listener that throws.
 */
import assert from "node:assert/strict";
import { after, afterEach, before, describe, test } from "node:test";

import {
  Code,
  ConnectError,
  DeferralReason,
  PermanentFailure,
  Worker,
  WindowPeriod,
  connect,
  queueRef,
  type ClaimedEvent,
  type Connection,
  type DeferredEvent,
  type DoorbellEvent,
  type SettledEvent,
  type Todo,
  type WorkerErrorInfo,
  type WorkerOptions,
} from "../src/index.js";
import { Harness, eventually, quiet, type ServerInfo } from "./harness.js";

const bytes = (s: string) => new TextEncoder().encode(s);
const TEST_TIMEOUT = 120_000;

async function ingest(c: Connection, queue: string, n: number): Promise<string[]> {
  const ids: string[] = [];
  for (let i = 0; i < n; i++) {
    const { todo } = await c.dispatch.ingest({ queue: { name: queue }, payload: bytes(`${i}`) });
    ids.push(todo!.id);
  }
  return ids;
}

/** Every event a worker emits, in order. */
function record(worker: Worker) {
  const seen = {
    claimed: [] as ClaimedEvent[],
    settled: [] as SettledEvent[],
    deferred: [] as DeferredEvent[],
    doorbell: [] as DoorbellEvent[],
    error: [] as Array<[Error, WorkerErrorInfo]>,
    order: [] as string[],
  };
  worker.on("claimed", (e) => {
    seen.claimed.push(e);
    for (const t of e.todos) seen.order.push(`claimed ${t.id}`);
  });
  worker.on("settled", (e) => {
    seen.settled.push(e);
    seen.order.push(`settled ${e.todoId}`);
  });
  worker.on("deferred", (e) => seen.deferred.push(e));
  worker.on("doorbell", (e) => seen.doorbell.push(e));
  worker.on("error", (error, info) => seen.error.push([error, info]));
  return seen;
}

describe("the worker's events against a real server", () => {
  let harness: Harness;
  const connections: Connection[] = [];
  const workers: Worker[] = [];

  before(async () => {
    harness = await Harness.start();
  });

  after(async () => {
    await Promise.all(connections.map((c) => c.close({ graceMs: 0 })));
    await harness?.close();
  });

  afterEach(() => {
    for (const worker of workers.splice(0)) worker.stop();
  });

  async function setUp(): Promise<{ server: ServerInfo; agent: Connection; human: Connection }> {
    const server = await harness.server();
    const agent = connect({ target: server.address, token: server.endpointToken, timeoutMs: 10_000 });
    const human = connect({ target: server.address, token: server.humanToken, timeoutMs: 10_000 });
    connections.push(agent, human);
    return { server, agent, human };
  }

  function workerFor(c: Connection, queue: string, options: Partial<WorkerOptions>): Worker {
    const worker = new Worker({
      transport: c.transport,
      handler: async () => {},
      queues: [queue],
      claimant: "ts-events",
      log: quiet,
      ...options,
    });
    workers.push(worker);
    return worker;
  }

  test("claimed: the todos of each batch; settled: one per todo, with its outcome", { timeout: TEST_TIMEOUT }, async () => {
    const { agent } = await setUp();
    const [ok1, ok2, retried, dead] = (await ingest(agent, "work", 4)) as [string, string, string, string];
    const worker = workerFor(agent, "work", {
      prefetch: 4,
      handler: async (todo: Todo) => {
        if (todo.id === retried) throw new Error("try later");
        if (todo.id === dead) throw new PermanentFailure("bad payload");
      },
    });
    const seen = record(worker);
    await worker.run({ maxTodos: 4 });

    assert.equal(seen.claimed.length, worker.stats.batches);
    const claimed = seen.claimed.flatMap((e) => e.todos);
    assert.deepEqual(new Set(claimed.map((t) => t.id)), new Set([ok1, ok2, retried, dead]));
    assert.deepEqual(claimed.map((t) => new TextDecoder().decode(t.payload)).sort(), ["0", "1", "2", "3"]);
    assert.ok(seen.claimed.every((e) => !e.cutShort));

    const byId = new Map(seen.settled.map((e) => [e.todoId, e]));
    assert.equal(seen.settled.length, 4);
    assert.deepEqual(byId.get(ok1), { todoId: ok1, outcome: "completed", permanent: false });
    assert.deepEqual(byId.get(ok2), { todoId: ok2, outcome: "completed", permanent: false });
    assert.deepEqual(byId.get(retried), { todoId: retried, outcome: "failed", permanent: false, error: "Error: try later" });
    assert.deepEqual(byId.get(dead), {
      todoId: dead,
      outcome: "failed",
      permanent: true,
      error: "PermanentFailure: bad payload",
    });
    // Each todo's claim comes before its settlement.
    for (const id of [ok1, ok2, retried, dead]) {
      assert.ok(seen.order.indexOf(`claimed ${id}`) < seen.order.indexOf(`settled ${id}`), seen.order.join(", "));
    }
    assert.deepEqual(seen.error, []);
    // The payloads are JSON (the todos in the proto3 JSON mapping).
    const json = JSON.parse(JSON.stringify(seen.claimed[0])) as { todos: Array<{ id: string; payload: string }> };
    assert.equal(json.todos[0]!.id, seen.claimed[0]!.todos[0]!.id);
    assert.equal(json.todos[0]!.payload, Buffer.from(seen.claimed[0]!.todos[0]!.payload).toString("base64"));
    assert.deepEqual(JSON.parse(JSON.stringify(seen.settled)), seen.settled);
  });

  test("a budgeted queue: claimed (cut short), deferred with its boundary, then claimed by the held claim at the boundary", { timeout: TEST_TIMEOUT }, async () => {
    const { server, agent, human } = await setUp();
    const noon = new Date(Date.now() + 86_400_000);
    noon.setUTCHours(12, 0, 0, 0);
    await harness.setClock(server.id, noon);
    const boundary = new Date(noon);
    boundary.setUTCHours(24, 0, 0, 0);
    await human.admission.setPolicy({
      policy: {
        queue: queueRef("budgeted", server.endpointId),
        maxClaimsPerWindow: 2,
        window: { period: WindowPeriod.DAY, timeZone: "UTC", start: "00:00" },
      },
    });
    const ids = await ingest(agent, "budgeted", 3);
    const worker = workerFor(agent, "budgeted", { prefetch: 10 });
    const seen = record(worker);
    const run = worker.run({ maxTodos: 3 });

    await eventually(() => seen.deferred.length >= 1 && seen.settled.length === 2);
    assert.equal(seen.claimed.length, 1);
    assert.ok(seen.claimed[0]!.cutShort);
    assert.deepEqual(new Set(seen.claimed[0]!.todos.map((t) => t.id)), new Set(ids.slice(0, 2)));
    const deferred = seen.deferred[0]!;
    assert.equal(deferred.queue, "budgeted");
    assert.equal(deferred.reason, DeferralReason.WINDOW_EXHAUSTED);
    assert.ok(deferred.exact);
    assert.equal(deferred.nextEligibleAt?.getTime(), boundary.getTime());
    assert.equal(deferred.detail.pending, 1n);
    const json = JSON.parse(JSON.stringify(deferred)) as { nextEligibleAt: string; detail: { pending: string } };
    assert.equal(json.nextEligibleAt, boundary.toISOString());
    assert.equal(json.detail.pending, "1");

    await harness.moveClock(server.id, (boundary.getTime() - (await harness.now(server.id)).getTime()) / 1000 + 1);
    await run;
    // The held ClaimNext took the last todo at the boundary: a second 'claimed', no doorbell.
    assert.equal(seen.claimed.length, 2);
    assert.deepEqual(seen.claimed[1]!.todos.map((t) => t.id), [ids[2]]);
    assert.ok(!seen.claimed[1]!.cutShort);
    assert.deepEqual(seen.doorbell, []);
    assert.equal(worker.stats.doorbells, 0);
    assert.deepEqual(new Set(seen.claimed.flatMap((e) => e.todos.map((t) => t.id))), new Set(ids));
  });

  test("no doorbell: an idle worker's held ClaimNext claims a new todo, told as 'claimed'", { timeout: TEST_TIMEOUT }, async () => {
    const { agent } = await setUp();
    const worker = workerFor(agent, "quiet", {});
    const seen = record(worker);
    const run = worker.run({ maxTodos: 1 });
    await eventually(() => worker.watching.isSet);
    const [id] = await ingest(agent, "quiet", 1);
    await run;
    assert.deepEqual(seen.doorbell, []);
    assert.equal(worker.stats.rpcCalls.ClaimNext, 1, "the held call claimed it");
    assert.deepEqual(seen.claimed.flatMap((e) => e.todos.map((t) => t.id)), [id]);
    assert.deepEqual(seen.settled, [{ todoId: id, outcome: "completed", permanent: false }]);
  });

  test("settled 'lost': a settlement refused because the lease was taken over", { timeout: TEST_TIMEOUT }, async () => {
    const { server, agent } = await setUp();
    const [id] = await ingest(agent, "work", 1);
    let gate!: () => void;
    const opened = new Promise<void>((r) => (gate = r));
    let started = false;
    const worker = workerFor(agent, "work", {
      leaseMs: 30_000,
      handler: async () => {
        started = true;
        await opened;
      },
    });
    const seen = record(worker);
    const run = worker.run({ maxTodos: 1 });
    await eventually(() => started);
    await harness.moveClock(server.id, 60); // the lease lapses on the server's clock
    const rival = await agent.dispatch.claimNext({ queues: ["work"], claimant: "rival" });
    assert.equal(rival.todo?.id, id);
    gate();
    await run;
    assert.deepEqual(seen.settled, [{ todoId: id, outcome: "lost", permanent: false }]);
    assert.equal(worker.stats.lost, 1);
  });

  test("settled 'cancelled': a todo an operator cancels while its handler runs (heartbeat, Complete)", { timeout: TEST_TIMEOUT }, async () => {
    const { agent, human } = await setUp();
    // The first todo's heartbeat says it was cancelled: its handler is aborted. The second's
    // handler returns before any heartbeat: its Complete is refused as cancelled.
    const [beaten, completed] = (await ingest(agent, "work", 2)) as [string, string];
    let gate!: () => void;
    const opened = new Promise<void>((r) => (gate = r));
    const started: string[] = [];
    let aborted = 0;
    const handler = (todo: Todo, signal: AbortSignal) =>
      new Promise<void>((resolve) => {
        started.push(todo.id);
        signal.addEventListener("abort", () => {
          aborted += 1;
          resolve();
        });
        if (todo.id === completed) void opened.then(resolve);
      });
    const beating = workerFor(agent, "work", { leaseMs: 30_000, heartbeatEveryMs: 200, handler });
    const seen = record(beating);
    const run = beating.run({ maxTodos: 1 });
    await eventually(() => started.length === 1);
    assert.equal(started[0], beaten);
    await human.dispatch.cancelTodo({ todoId: beaten });
    await run; // the next heartbeat says cancelled: counted, never thrown
    assert.equal(aborted, 1);
    assert.deepEqual(seen.settled, [{ todoId: beaten, outcome: "cancelled", permanent: false }]);
    assert.deepEqual([beating.stats.cancelled, beating.stats.lost, beating.stats.released], [1, 0, 0]);
    assert.equal(beating.stats.rpcCalls.Heartbeat >= 1, true);
    assert.equal(beating.stats.rpcCalls.Release, 0);

    const settling = workerFor(agent, "work", { leaseMs: 30_000, heartbeatEveryMs: 20_000, handler });
    const seen2 = record(settling);
    const run2 = settling.run({ maxTodos: 1 });
    await eventually(() => started.length === 2);
    await human.dispatch.cancelTodo({ todoId: completed });
    gate();
    await run2;
    assert.deepEqual(seen2.settled, [{ todoId: completed, outcome: "cancelled", permanent: false }]);
    assert.deepEqual([settling.stats.cancelled, settling.stats.lost, settling.stats.completed], [1, 0, 0]);
    assert.equal(settling.stats.rpcCalls.Complete, 1, "refused as cancelled: not retried");
    assert.deepEqual(seen.error.concat(seen2.error), []);
  });

  test("settled 'released': a handler still running when the stop's grace runs out", { timeout: TEST_TIMEOUT }, async () => {
    const { agent } = await setUp();
    const [id] = await ingest(agent, "work", 1);
    let started = false;
    const worker = workerFor(agent, "work", {
      shutdownGraceMs: 100,
      handler: (_todo: Todo, signal: AbortSignal) =>
        new Promise<void>((resolve) => {
          started = true;
          signal.addEventListener("abort", () => resolve());
        }),
    });
    const seen = record(worker);
    const run = worker.run();
    await eventually(() => started);
    worker.stop();
    await run;
    assert.deepEqual(seen.settled, [{ todoId: id, outcome: "released", permanent: false }]);
    assert.equal(worker.stats.released, 1);
  });

  test("error: a refused ClaimNext is emitted, then run() rejects with the same error", { timeout: TEST_TIMEOUT }, async () => {
    const { server } = await setUp();
    const stranger = connect({ target: server.address, token: "sbe_not-a-real-token", timeoutMs: 10_000 });
    connections.push(stranger);
    const worker = workerFor(stranger, "work", {});
    const seen = record(worker);
    const rejected = await worker.run().then(
      () => assert.fail("run() should reject"),
      (err: unknown) => err,
    );
    assert.ok(rejected instanceof ConnectError);
    assert.equal(rejected.code, Code.Unauthenticated);
    const claims = seen.error.filter(([, info]) => info.rpc === "ClaimNext");
    assert.equal(claims.length, 1);
    assert.equal(claims[0]![0], rejected);
    assert.deepEqual(claims[0]![1], { rpc: "ClaimNext", retrying: false });

    // Nobody listens to 'error': nothing is thrown from the emitter, run() rejects as before.
    const unheard = workerFor(stranger, "work", {});
    await assert.rejects(unheard.run(), (err: unknown) => err instanceof ConnectError && err.code === Code.Unauthenticated);
  });

  test("error: ClaimNext against a stopped server is emitted as retrying, and the worker rides it out", { timeout: TEST_TIMEOUT }, async () => {
    const { server, agent } = await setUp();
    const [id] = await ingest(agent, "work", 1);
    await harness.kill(server.id);
    const worker = workerFor(agent, "work", {});
    const seen = record(worker);
    const run = worker.run({ maxTodos: 1 });
    await eventually(() => seen.error.some(([, info]) => info.rpc === "ClaimNext"));
    const [error, info] = seen.error.find(([, i]) => i.rpc === "ClaimNext")!;
    assert.deepEqual(info, { rpc: "ClaimNext", retrying: true });
    assert.equal(ConnectError.from(error).code, Code.Unavailable);
    await harness.startAgain(server.id);
    await run;
    assert.deepEqual(seen.settled, [{ todoId: id, outcome: "completed", permanent: false }]);
    assert.ok(seen.error.every(([, i]) => i.retrying), "every error was retried");
  });

  test("a listener that throws is logged; the worker carries on", { timeout: TEST_TIMEOUT }, async () => {
    const { agent } = await setUp();
    await ingest(agent, "work", 2);
    const errors: string[] = [];
    const worker = workerFor(agent, "work", {
      prefetch: 1,
      log: { debug() {}, info() {}, warn() {}, error: (m: string) => void errors.push(m) },
    });
    worker.on("claimed", () => {
      throw new Error("a broken dashboard");
    });
    worker.on("settled", () => {
      throw new Error("another");
    });
    await worker.run({ maxTodos: 2 });
    assert.deepEqual([worker.stats.claimed, worker.stats.completed], [2, 2]);
    assert.equal(errors.filter((m) => m.startsWith("a 'claimed' listener threw: Error: a broken dashboard")).length, 2);
    assert.equal(errors.filter((m) => m.startsWith("a 'settled' listener threw: Error: another")).length, 2);
  });
});
