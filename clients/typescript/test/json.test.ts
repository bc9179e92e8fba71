/**
 * `JSON.stringify` on what the package hands to applications: call answers (unary and
 * streamed, nested messages too), the worker's `Todo`, `stats`, `lastDeferred` and
 * `lastDoorbell` (undefined now; over a transport the package did not make), and `richError`. Each writes
 * the proto3 JSON mapping (int64 as decimal strings) and reads back to equal values.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { create, equals, fromJson, type DescMessage, type JsonObject, type MessageShape } from "@bufbuild/protobuf";
import { timestampFromDate } from "@bufbuild/protobuf/wkt";
import { createGrpcTransport } from "@connectrpc/connect-node";

import {
  CancelTodosResponseSchema,
  DeferralDetailSchema,
  DeferredQueueSchema,
  DoorbellSchema,
  GetTodoResponseSchema,
  TodoSchema,
  TodoState,
  WatchReopenResponseSchema,
  WindowPeriod,
  Worker,
  bearer,
  connect,
  jsonable,
  queueRef,
  richError,
  type Connection,
  type Todo,
} from "../src/index.js";
import { Harness, eventually, quiet, sleep, type ServerInfo } from "./harness.js";

const TEST_TIMEOUT = 120_000;

/** `JSON.stringify` works on `message`, and `fromJson` reads what it wrote back to an equal message. */
function roundTrips<Desc extends DescMessage>(schema: Desc, message: MessageShape<Desc>): Record<string, unknown> {
  const text = JSON.stringify(message);
  const json = JSON.parse(text) as JsonObject;
  assert.ok(equals(schema, fromJson(schema, json), message), text);
  return json as Record<string, unknown>;
}

describe("JSON.stringify on what the package hands out", () => {
  let harness: Harness;
  let server: ServerInfo;
  let agent: Connection;
  let human: Connection;

  before(async () => {
    harness = await Harness.start();
    server = await harness.server();
    agent = connect({ target: server.address, token: server.endpointToken, timeoutMs: 10_000 });
    human = connect({ target: server.address, token: server.humanToken, timeoutMs: 10_000 });
  });

  after(async () => {
    await agent?.close({ graceMs: 0 });
    await human?.close({ graceMs: 0 });
    await harness?.close();
  });

  test("int64 as decimal strings, beyond 2^53 too, and bytes as base64", () => {
    const big = 2n ** 63n - 1n;
    const deferred = jsonable(
      DeferredQueueSchema,
      create(DeferredQueueSchema, { pending: big, nextEligibleAt: timestampFromDate(new Date("2030-01-02T03:04:05Z")) }),
    );
    assert.throws(() => JSON.stringify({ pending: big }), TypeError); // what it saves us from
    const json = roundTrips(DeferredQueueSchema, deferred);
    assert.equal(json.pending, "9223372036854775807");
    assert.equal(json.nextEligibleAt, "2030-01-02T03:04:05Z");
    // Nested messages have their own toJSON: stringified alone, they write the mapping too.
    assert.equal(JSON.stringify(deferred.nextEligibleAt), '"2030-01-02T03:04:05Z"');
    // Not enumerable: spreads and deep equality do not see it.
    assert.ok(!Object.keys(deferred).includes("toJSON"));
    assert.deepEqual(deferred, create(DeferredQueueSchema, { pending: big, nextEligibleAt: deferred.nextEligibleAt }));
  });

  test("call answers: unary with nested messages, bulk counts, and a streamed doorbell", { timeout: TEST_TIMEOUT }, async () => {
    const payload = new Uint8Array([0, 255, 1]);
    const { todo } = await agent.dispatch.ingest({ queue: { name: "json" }, payload, contentType: "application/x-test" });
    const got = await agent.dispatch.getTodo({ todoId: todo!.id });
    const json = roundTrips(GetTodoResponseSchema, got);
    const t = json.todo as Record<string, unknown>;
    assert.equal(t.payload, "AP8B");
    assert.match(t.createdAt as string, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$/);
    assert.equal(t.state, "TODO_STATE_PENDING");
    roundTrips(TodoSchema, got.todo!);

    const cancelled = await human.dispatch.cancelTodos({ todoIds: [todo!.id] });
    assert.equal(cancelled.count, 1n);
    assert.equal(roundTrips(CancelTodosResponseSchema, cancelled).count, "1");

    await agent.dispatch.ingest({ queue: { name: "bell" }, payload: new Uint8Array([1]) });
    const stop = new AbortController();
    const stream = agent.dispatch.watchReopen({ queues: ["bell"] }, { signal: stop.signal, timeoutMs: 0 });
    for await (const message of stream) {
      // ATTACHED: the subscription found work waiting, with its pending count (an int64).
      const bell = roundTrips(WatchReopenResponseSchema, message).doorbell as Record<string, unknown>;
      assert.equal(typeof bell.pending, "string");
      assert.equal(BigInt(bell.pending as string), message.doorbell!.pending);
      roundTrips(DoorbellSchema, message.doorbell!);
      break;
    }
    stop.abort();
  });

  test("the worker's Todo, stats and lastDeferred, over a transport the package did not make", { timeout: TEST_TIMEOUT }, async () => {
    await human.admission.setPolicy({
      policy: {
        queue: queueRef("budgeted", server.endpointId),
        maxClaimsPerWindow: 1,
        window: { period: WindowPeriod.DAY, timeZone: "UTC", start: "00:00" },
      },
    });
    for (const text of ["a", "b"]) {
      await agent.dispatch.ingest({ queue: { name: "budgeted" }, payload: new TextEncoder().encode(text) });
    }
    const transport = createGrpcTransport({
      baseUrl: `http://${server.address}`,
      interceptors: [bearer(server.endpointToken)],
    });
    const handed: Array<{ todo: Todo; text: string }> = [];
    const worker = new Worker({
      transport,
      handler: async (todo) => {
        handed.push({ todo, text: JSON.stringify(todo) });
      },
      queues: ["budgeted"],
      claimant: "ts-json",
      // Held claims of a second: one comes back empty, listing the deferred queue.
      maxIdleWaitMs: 1000,
      log: quiet,
    });
    const run = worker.run();
    await eventually(() => worker.stats.completed === 1 && worker.stats.deferredWaits >= 1 && worker.watching.isSet);
    // A new todo; the budget still defers it (the held claim does not take it).
    await agent.dispatch.ingest({ queue: { name: "budgeted" }, payload: new Uint8Array([2]) });
    await sleep(300);
    worker.stop();
    await run;

    assert.equal(handed.length, 1);
    const { todo, text } = handed[0]!;
    assert.ok(equals(TodoSchema, fromJson(TodoSchema, JSON.parse(text)), todo), text);
    assert.equal((JSON.parse(text) as { payload: string }).payload, Buffer.from("a").toString("base64"));

    const [deferred] = worker.lastDeferred;
    assert.ok(deferred);
    assert.equal(roundTrips(DeferredQueueSchema, deferred).pending, String(deferred.pending));
    assert.ok(deferred.pending >= 1n);
    assert.equal(worker.lastDoorbell, undefined, "no doorbell stream any more");

    const stats = JSON.parse(JSON.stringify(worker.stats)) as Record<string, unknown>;
    assert.deepEqual(stats, { ...worker.stats, rpcCalls: { ...worker.stats.rpcCalls } });
    assert.equal(stats.completed, 1);
  });

  test("richError of a deferred Claim: code by name, details in the mapping, the time as ISO", { timeout: TEST_TIMEOUT }, async () => {
    // After the test above, the budgeted queue's window is spent and two todos wait.
    const { todos } = await agent.dispatch.listTodos({ queues: ["budgeted"], states: [TodoState.PENDING] });
    let caught: unknown;
    try {
      await agent.dispatch.claim({ todoId: todos[0]!.id, claimant: "ts-json" });
    } catch (err) {
      caught = err;
    }
    const e = richError(caught);
    assert.ok(e.deferral && e.nextEligibleAt);
    const json = JSON.parse(JSON.stringify(e)) as Record<string, unknown>;
    assert.equal(json.code, "ResourceExhausted");
    assert.equal(json.message, e.message);
    assert.equal(json.nextEligibleAt, e.nextEligibleAt.toISOString());
    assert.equal(json.retryDelayMs, e.retryDelayMs);
    assert.ok(equals(DeferralDetailSchema, fromJson(DeferralDetailSchema, json.deferral as never), e.deferral));
    assert.equal((json.deferral as { pending: string }).pending, String(e.deferral.pending));
    assert.equal((json.errorInfo as { reason: string }).reason, "DEFERRED");
    assert.ok(!("error" in json));
    roundTrips(DeferralDetailSchema, e.deferral);
  });
});
