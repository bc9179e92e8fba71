/**
 * The Worker against real server processes: a batched drain, a budgeted queue whose held claim
 * takes the rest at its window boundary, a lease taken over mid-handler, and a server restart
 * mid-drain. (tests/contract/worker_scenarios.json, run by contract.test.ts, has the rest.)
 */
import assert from "node:assert/strict";
import { after, afterEach, before, describe, test } from "node:test";

import { create, toBinary } from "@bufbuild/protobuf";

import {
  DeferralReason,
  MAX_SEND_BYTES,
  PermanentFailure,
  SettleTodosRequestSchema,
  SettlementSchema,
  TodoState,
  Worker,
  WindowPeriod,
  connect,
  queueRef,
  type Connection,
  type Todo,
  type WorkerOptions,
} from "../src/index.js";
import { MAX_BATCH, MAX_BATCH_BYTES } from "../src/worker/common.js";
import type { Held } from "../src/worker/held.js";
import { bySize } from "../src/worker/settler.js";
import { Harness, eventually, quiet, sleep, type ServerInfo } from "./harness.js";

const bytes = (s: string) => new TextEncoder().encode(s);

/** Generous: a test that hangs fails instead of stalling CI. */
const TEST_TIMEOUT = 120_000;

/** Ingests `n` todos into `queue`, `parallel` calls at a time; their ids in order. */
async function ingest(c: Connection, queue: string, n: number, parallel = 25): Promise<string[]> {
  const ids: string[] = new Array(n);
  let next = 0;
  await Promise.all(
    Array.from({ length: Math.min(parallel, n) }, async () => {
      while (next < n) {
        const i = next++;
        const { todo } = await c.dispatch.ingest({ queue: { name: queue }, payload: bytes(`${i}`) });
        ids[i] = todo!.id;
      }
    }),
  );
  return ids;
}

/** States and completed attempts of every todo of the server's database. */
async function outcomes(harness: Harness, id: number) {
  return harness.query<{ state: string; n: number; completed: number }>(
    id,
    `SELECT t.state::text AS state, count(*)::int AS n,
            sum((SELECT count(*) FROM attempts a WHERE a.todo_id = t.id AND a.outcome = 'completed'))::int
              AS completed
       FROM todos t GROUP BY t.state`,
  );
}

describe("the worker against a real server", () => {
  let harness: Harness;
  const connections: Connection[] = [];

  before(async () => {
    harness = await Harness.start();
  });

  after(async () => {
    await Promise.all(connections.map((c) => c.close()));
    await harness?.close();
  });

  async function setUp(): Promise<{ server: ServerInfo; agent: Connection; human: Connection }> {
    const server = await harness.server();
    const agent = connect({ target: server.address, token: server.endpointToken, timeoutMs: 10_000 });
    const human = connect({ target: server.address, token: server.humanToken, timeoutMs: 10_000 });
    connections.push(agent, human);
    return { server, agent, human };
  }

  const workers: Worker[] = [];

  afterEach(async () => {
    // A failed test must not leave its worker running (and the process alive).
    for (const worker of workers.splice(0)) worker.stop();
  });

  function workerFor(agent: Connection, queue: string, options: Partial<WorkerOptions>): Worker {
    const worker = new Worker({
      transport: agent.transport,
      handler: async () => {},
      queues: [queue],
      claimant: "ts-worker",
      log: quiet,
      ...options,
    });
    workers.push(worker);
    return worker;
  }

  test("drains 1,000 todos with prefetch 100 and concurrency 100, each completed once", { timeout: TEST_TIMEOUT }, async () => {
    const { server, agent } = await setUp();
    const ids = await ingest(agent, "work", 1000);
    const handled = new Map<string, number>();
    let running = 0;
    let mostRunning = 0;
    const worker = workerFor(agent, "work", {
      prefetch: 100,
      concurrency: 100,
      handler: async (todo: Todo) => {
        running += 1;
        mostRunning = Math.max(mostRunning, running);
        handled.set(todo.id, (handled.get(todo.id) ?? 0) + 1);
        await sleep(2);
        running -= 1;
      },
    });
    await worker.run({ maxTodos: 1000 });

    assert.equal(handled.size, 1000);
    assert.ok([...handled.values()].every((n) => n === 1));
    assert.deepEqual(new Set(handled.keys()), new Set(ids));
    assert.ok(mostRunning <= 100);
    const s = worker.stats;
    assert.deepEqual([s.claimed, s.completed, s.failed, s.lost, s.unsettled], [1000, 1000, 0, 0, 0]);
    // Batches: a claim refills at least half the slots (50), at most prefetch (100).
    assert.ok(s.batches >= 10 && s.batches <= 20, `batches ${s.batches}`);
    assert.equal(s.rpcCalls.ClaimNext, s.batches, JSON.stringify(s.rpcCalls));
    assert.ok(s.rpcCalls.SettleTodos >= 10 && s.rpcCalls.SettleTodos <= 100, JSON.stringify(s.rpcCalls));
    assert.equal(s.rpcCalls.Complete + s.rpcCalls.Fail + s.rpcCalls.Release + s.rpcCalls.Heartbeat, 0);
    assert.deepEqual(await outcomes(harness, server.id), [{ state: "done", n: 1000, completed: 1000 }]);
  });

  test("a thrown error fails the todo; PermanentFailure dead-letters it", { timeout: TEST_TIMEOUT }, async () => {
    const { agent } = await setUp();
    const [retried, dead] = await ingest(agent, "flaky", 2, 1);
    const worker = workerFor(agent, "flaky", {
      prefetch: 2,
      handler: async (todo: Todo) => {
        if (todo.id === dead) throw new PermanentFailure("bad payload");
        throw new Error("try later");
      },
    });
    await worker.run({ maxTodos: 2 });
    const s = worker.stats;
    assert.deepEqual([s.claimed, s.failed, s.deadLettered, s.completed], [2, 2, 1, 0]);
    const a = await agent.dispatch.getTodo({ todoId: retried! });
    assert.equal(a.todo?.state, TodoState.PENDING);
    assert.equal(a.todo?.lastError, "Error: try later");
    const b = await agent.dispatch.getTodo({ todoId: dead! });
    assert.equal(b.todo?.state, TodoState.DEAD);
    assert.equal(b.todo?.lastError, "PermanentFailure: bad payload");
  });

  test("a budgeted queue: claims 5, then one held ClaimNext waits for the boundary and takes the rest", { timeout: TEST_TIMEOUT }, async () => {
    const { server, agent, human } = await setUp();
    const noon = new Date(Date.now() + 86_400_000);
    noon.setUTCHours(12, 0, 0, 0);
    await harness.setClock(server.id, noon);
    const boundary = new Date(noon);
    boundary.setUTCHours(24, 0, 0, 0);
    await human.admission.setPolicy({
      policy: {
        queue: queueRef("budgeted", server.endpointId),
        maxClaimsPerWindow: 5,
        window: { period: WindowPeriod.DAY, timeZone: "UTC", start: "00:00" },
      },
    });
    const ids = await ingest(agent, "budgeted", 8, 1);
    const seen: string[] = [];
    const worker = workerFor(agent, "budgeted", {
      prefetch: 10,
      handler: async (todo: Todo) => {
        seen.push(todo.id);
      },
    });
    const run = worker.run({ maxTodos: 8 });

    // One batch of 5, cut short by the budget: settled, then one ClaimNext held at the server.
    await eventually(() => worker.stats.completed === 5 && worker.watching.isSet);
    const [deferred] = worker.lastDeferred;
    assert.equal(deferred?.queue?.name, "budgeted");
    assert.equal(deferred?.reason, DeferralReason.WINDOW_EXHAUSTED);
    assert.ok(deferred?.exact);
    assert.deepEqual(new Set(seen), new Set(ids.slice(0, 5)));
    const rpcs = () => Object.values(worker.stats.rpcCalls).reduce((a, b) => a + b, 0);
    const before = rpcs();
    await sleep(1500);
    assert.equal(rpcs(), before, "no RPC while deferred");
    const s = worker.stats;
    assert.deepEqual([s.claimed, s.batches, s.cutShort, s.failed], [5, 1, 1, 0]);
    assert.equal(s.rpcCalls.ClaimNext, 2, JSON.stringify(s.rpcCalls));

    // The server's clock crosses the boundary; the held claim takes the other three.
    await harness.moveClock(server.id, (boundary.getTime() - (await harness.now(server.id)).getTime()) / 1000 + 1);
    await run;
    assert.ok(Date.now() < boundary.getTime() - 12 * 3_600_000, "woken by the server, not the local clock");
    assert.equal(worker.stats.rpcCalls.ClaimNext, 2, "the held ClaimNext claimed them");
    assert.equal(worker.stats.rpcCalls.WatchReopen, 0);
    assert.equal(worker.lastDoorbell, undefined);
    assert.deepEqual(new Set(seen), new Set(ids));
    assert.deepEqual([worker.stats.claimed, worker.stats.completed], [8, 8]);
  });

  test("a lease taken over mid-handler: the handler is aborted, the refused settlement counted", { timeout: TEST_TIMEOUT }, async () => {
    const { server, agent } = await setUp();
    const [first, second] = await ingest(agent, "work", 2, 1);
    let aborted = false;
    let gate!: () => void;
    const opened = new Promise<void>((r) => (gate = r));
    const started = new Set<string>();
    const worker = workerFor(agent, "work", {
      prefetch: 2,
      // The takeover below must land before the first heartbeat, 9 s after the claim.
      leaseMs: 10_000,
      heartbeatEveryMs: 9_000,
      handler: async (todo: Todo, signal: AbortSignal) => {
        started.add(todo.id);
        if (todo.id === second) return opened; // finishes once taken over: its settlement is refused
        await new Promise<void>((resolve) =>
          signal.addEventListener("abort", () => {
            aborted = true;
            resolve();
          }),
        );
      },
    });
    const run = worker.run({ maxTodos: 2 });
    await eventually(() => started.size === 2);
    await harness.moveClock(server.id, 60); // every lease lapses on the server's clock
    for (const expected of [first, second]) {
      const rival = await agent.dispatch.claimNext({ queues: ["work"], claimant: "rival" });
      assert.equal(rival.todo?.id, expected);
      assert.equal(rival.todo?.attempt, 2);
    }
    gate();
    await run; // resolves: a lost lease is counted, never thrown

    assert.ok(aborted, "the first handler was aborted");
    const s = worker.stats;
    assert.deepEqual([s.lost, s.completed, s.failed, s.released], [2, 0, 0, 0]);
    assert.equal(s.rpcCalls.SettleTodos, 1); // the second todo's, refused
    assert.equal(s.rpcCalls.Heartbeat, 1); // the first todo's, refused: its handler aborted
    for (const todoId of [first!, second!]) {
      const got = await agent.dispatch.getTodo({ todoId });
      assert.equal(got.todo?.state, TodoState.CLAIMED);
      assert.equal(got.todo?.claimant, "rival");
    }
  });

  test("a server restart mid-drain: the worker reconnects, nothing lost or completed twice", { timeout: TEST_TIMEOUT }, async () => {
    const { server, agent } = await setUp();
    const ids = await ingest(agent, "work", 400);
    const handled = new Map<string, number>();
    const worker = workerFor(agent, "work", {
      prefetch: 20,
      concurrency: 20,
      // A claim whose answer the stopping server never sent lapses soon and is taken over;
      // long enough that settlements retried across the restart (slow on a loaded machine)
      // still hold their leases.
      leaseMs: 12_000,
      handler: async (todo: Todo) => {
        handled.set(todo.id, (handled.get(todo.id) ?? 0) + 1);
        await sleep(20);
      },
    });
    const run = worker.run({ maxTodos: 400 });
    await eventually(() => worker.stats.completed >= 60);
    await harness.kill(server.id);
    const during = worker.stats.completed;
    assert.ok(during < 400, "restarted mid-drain");
    await harness.startAgain(server.id);
    await run;

    assert.equal(handled.size, 400);
    assert.ok([...handled.values()].every((n) => n === 1), "no todo handled twice");
    assert.deepEqual(new Set(handled.keys()), new Set(ids));
    const s = worker.stats;
    assert.deepEqual([s.claimed, s.completed, s.lost, s.unsettled], [400, 400, 0, 0]);
    assert.equal(s.rpcCalls.WatchReopen, 0, "no doorbell stream: the claims are held");
    assert.deepEqual(await outcomes(harness, server.id), [{ state: "done", n: 400, completed: 400 }]);
  });

  test("stop() through an AbortSignal: running handlers finish, their outcomes are flushed", { timeout: TEST_TIMEOUT }, async () => {
    const { agent } = await setUp();
    await ingest(agent, "work", 3, 1);
    const stop = new AbortController();
    let finished = 0;
    const worker = workerFor(agent, "work", {
      prefetch: 3,
      settleLingerMs: 60_000,
      settleBatch: 100,
      handler: async () => {
        await sleep(200);
        finished += 1;
      },
    });
    const run = worker.run({ signal: stop.signal });
    await eventually(() => worker.held === 3);
    stop.abort();
    await run;
    assert.equal(finished, 3);
    assert.equal(worker.stats.completed, 3);
    // Flushed at once on stop (not after the 60 s linger), in SettleTodos batches.
    assert.ok(worker.stats.rpcCalls.SettleTodos >= 1 && worker.stats.rpcCalls.SettleTodos <= 3);
    assert.equal(worker.stats.rpcCalls.Complete, 0);
    assert.equal(worker.held, 0);
    assert.ok(!worker.watching.isSet);
  });
});

describe("settle batches", () => {
  const held = (n: number, error: string): Held => ({
    todoId: String(n),
    leaseId: "00000000-0000-4000-8000-000000000000",
    settlement: create(SettlementSchema, {
      todoId: String(n),
      leaseId: "00000000-0000-4000-8000-000000000000",
      action: { case: "fail", value: { error, permanent: false } },
    }),
  }) as Held;

  test("are cut into calls by their encoded size, each within the server's request limit", () => {
    // The largest failures (every character 4 bytes of UTF-8), a full batch of them.
    const batch = Array.from({ length: MAX_BATCH }, (_, n) => held(n, "\u{1f600}".repeat(4096)));
    const runs = bySize(batch);
    assert.deepEqual(runs.flat(), batch); // in order, none left out
    assert.ok(runs.length > 1);
    for (const run of runs) {
      const request = create(SettleTodosRequestSchema, { settlements: run.map((h) => h.settlement!) });
      assert.ok(toBinary(SettleTodosRequestSchema, request).length <= MAX_BATCH_BYTES);
    }
    assert.equal(MAX_BATCH_BYTES, MAX_SEND_BYTES - 64 * 1024);
    const small = Array.from({ length: MAX_BATCH }, (_, n) => held(n, ""));
    assert.deepEqual(bySize(small), [small]);
    // One that alone is over the budget gets a call of its own; the rest still fit.
    const [big, ...rest] = Array.from({ length: 5 }, (_, n) => held(n, "x".repeat(n === 0 ? 400 : 100)));
    assert.deepEqual(bySize([big!, ...rest], 300), [[big], rest.slice(0, 2), rest.slice(2)]);
  });
});
