/**
 * Every RPC of DispatchService, AdmissionService and ScheduleService, once with a success and once refused
 * (a test below checks the list against the service descriptors),
 * against a real server; rich errors decoded into typed details.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, describe, test } from "node:test";

import { timestampMs } from "@bufbuild/protobuf/wkt";

import {
  AdmissionService,
  BatchItemStatus,
  CatchUp,
  ScheduleAction,
  ScheduleService,
  BulkItemStatus,
  DispatchService,
  Code,
  DeferralReason,
  DoorbellCause,
  PolicyAction,
  TodoState,
  WindowPeriod,
  connect,
  durationMs,
  isDeferred,
  queueRef,
  richError,
  type Connection,
  type Todo,
} from "../src/index.js";
import { Harness, type ServerInfo } from "./harness.js";

const bytes = (s: string) => new TextEncoder().encode(s);

/** Runs `call`, expects it to fail with `code`; the decoded error. */
async function refused(code: Code, call: () => Promise<unknown>) {
  try {
    await call();
  } catch (err) {
    const e = richError(err);
    assert.equal(Code[e.code], Code[code], e.message);
    return e;
  }
  assert.fail(`expected ${Code[code]}`);
}

describe("the client against a real server", () => {
  let harness: Harness;
  let server: ServerInfo;
  let agent: Connection; // the endpoint credential
  let human: Connection;
  let stranger: Connection; // a token the server does not know
  const NO_SUCH_TODO = "999999999";
  const NO_SUCH_LEASE = "00000000-0000-4000-8000-000000000000";

  before(async () => {
    harness = await Harness.start();
    server = await harness.server();
    agent = connect({ target: server.address, token: server.endpointToken, timeoutMs: 10_000 });
    human = connect({ target: server.address, token: server.humanToken, timeoutMs: 10_000 });
    stranger = connect({ target: server.address, token: "sbe_not-a-real-token", timeoutMs: 10_000 });
  });

  after(async () => {
    await Promise.all([agent, human, stranger].map((c) => c?.close()));
    await harness?.close();
  });

  test("Ingest, GetTodo, ListTodos", { timeout: 60_000 }, async () => {
    const { todo, deduplicated } = await agent.dispatch.ingest({
      queue: { name: "work" },
      payload: bytes("hello"),
      contentType: "text/plain",
      dedup: { webhookId: "wh", deliveryId: "d1" },
    });
    assert.ok(todo && !deduplicated);
    assert.equal(todo.state, TodoState.PENDING);
    const again = await agent.dispatch.ingest({
      queue: { name: "work" },
      payload: bytes("hello"),
      dedup: { webhookId: "wh", deliveryId: "d1" },
    });
    assert.equal(again.todo?.id, todo.id);
    assert.ok(again.deduplicated);
    const bad = await refused(Code.InvalidArgument, () =>
      agent.dispatch.ingest({ queue: { name: "no spaces allowed" }, payload: bytes("x") }),
    );
    assert.ok(bad.badRequest, "a BadRequest detail");
    assert.ok(bad.badRequest.fieldViolations.some((v) => v.field.includes("queue")), JSON.stringify(bad.badRequest));

    const got = await agent.dispatch.getTodo({ todoId: todo.id });
    assert.equal(new TextDecoder().decode(got.todo?.payload), "hello");
    await refused(Code.NotFound, () => agent.dispatch.getTodo({ todoId: NO_SUCH_TODO }));

    const listed = await agent.dispatch.listTodos({ queues: ["work"], states: [TodoState.PENDING] });
    assert.deepEqual(
      listed.todos.map((t) => t.id),
      [todo.id],
    );
    await refused(Code.InvalidArgument, () => agent.dispatch.listTodos({ pageSize: 501 }));
  });

  test("IngestTodos with idempotency keys; GetTodo and ListTodos by key", { timeout: 60_000 }, async () => {
    const { results } = await agent.dispatch.ingestTodos({
      todos: [
        { queue: { name: "keyed" }, payload: bytes("a"), idempotencyKey: "order-1" },
        { queue: { name: "keyed" }, payload: bytes("b"), idempotencyKey: "order-1" },
        { queue: { name: "other" }, payload: bytes("c"), idempotencyRetention: undefined },
      ],
    });
    assert.deepEqual(
      results.map((r) => r.deduplicated),
      [false, true, false],
    );
    const first = results[0]!.todo!;
    const second = results[1]!.todo!;
    assert.equal(second.id, first.id);
    assert.equal(first.idempotencyKey, "order-1");
    assert.equal(first.traceparent, "");
    const byKey = await agent.dispatch.getTodo({ idempotencyKey: { queue: "keyed", key: "order-1" } });
    assert.equal(byKey.todo?.id, first.id);
    const listed = await agent.dispatch.listTodos({ idempotencyKey: "order-1" });
    assert.deepEqual(
      listed.todos.map((t) => t.id),
      [first.id],
    );
    const bad = await refused(Code.InvalidArgument, () =>
      agent.dispatch.ingestTodos({ todos: [{ queue: { name: "keyed" } }, { queue: { name: "bad name" } }] }),
    );
    assert.ok(bad.badRequest?.fieldViolations.some((v) => v.field === "todos[1].queue.name"));
  });

  test("Priorities: the most urgent first; out of range refused", { timeout: 60_000 }, async () => {
    const { results } = await agent.dispatch.ingestTodos({
      todos: [
        { queue: { name: "ranked" }, payload: bytes("later"), priority: 6 },
        { queue: { name: "ranked" }, payload: bytes("sooner"), priority: 1 },
      ],
    });
    assert.deepEqual(
      results.map((r) => r.todo?.priority),
      [6, 1],
    );
    const claimed = await agent.dispatch.claimNext({ queues: ["ranked"], claimant: "ts", maxTodos: 2 });
    assert.deepEqual(
      claimed.claimed.map((c) => [c.todo?.id, c.todo?.priority]),
      [
        [results[1]!.todo!.id, 1],
        [results[0]!.todo!.id, 6],
      ],
    );
    const bad = await refused(Code.InvalidArgument, () =>
      agent.dispatch.ingestTodos({ todos: [{ queue: { name: "ranked" }, priority: 10 }] }),
    );
    assert.ok(bad.badRequest?.fieldViolations.some((v) => v.field === "todos[0].priority"));
  });

  test("Claim, Heartbeat, Complete; and their refusals", { timeout: 60_000 }, async () => {
    const { todo } = await agent.dispatch.ingest({ queue: { name: "single" }, payload: bytes("1") });
    const claimed = await agent.dispatch.claim({ todoId: todo!.id, claimant: "ts", leaseDuration: { seconds: 60n } });
    assert.equal(claimed.todo?.state, TodoState.CLAIMED);
    const leaseId = claimed.lease!.leaseId;
    await refused(Code.FailedPrecondition, () => agent.dispatch.claim({ todoId: todo!.id, claimant: "ts" }));

    const beat = await agent.dispatch.heartbeat({ todoId: todo!.id, leaseId, leaseDuration: { seconds: 120n } });
    assert.ok(beat.lease && timestampMs(beat.lease.expiresAt!) > Date.now() + 60_000);
    await refused(Code.FailedPrecondition, () =>
      agent.dispatch.heartbeat({ todoId: todo!.id, leaseId: NO_SUCH_LEASE }),
    );

    const done = await agent.dispatch.complete({ todoId: todo!.id, leaseId });
    assert.equal(done.todo?.state, TodoState.DONE);
    await refused(Code.FailedPrecondition, () => agent.dispatch.complete({ todoId: todo!.id, leaseId }));
  });

  test("ClaimNext, Fail, Release", { timeout: 60_000 }, async () => {
    await refused(Code.Unauthenticated, () => stranger.dispatch.claimNext({ queues: ["retry"], claimant: "ts" }));
    const [a, b] = [
      await agent.dispatch.ingest({ queue: { name: "retry" }, payload: bytes("a") }),
      await agent.dispatch.ingest({ queue: { name: "retry" }, payload: bytes("b") }),
    ];
    const first = await agent.dispatch.claimNext({ queues: ["retry"], claimant: "ts" });
    assert.equal(first.todo?.id, a.todo?.id);
    const failed = await agent.dispatch.fail({
      todoId: first.todo!.id,
      leaseId: first.lease!.leaseId,
      error: "boom",
      permanent: true,
    });
    assert.equal(failed.todo?.state, TodoState.DEAD);
    await refused(Code.FailedPrecondition, () =>
      agent.dispatch.fail({ todoId: first.todo!.id, leaseId: first.lease!.leaseId, error: "again" }),
    );

    const second = await agent.dispatch.claimNext({ queues: ["retry"], claimant: "ts" });
    assert.equal(second.todo?.id, b.todo?.id);
    const released = await agent.dispatch.release({ todoId: second.todo!.id, leaseId: second.lease!.leaseId });
    assert.equal(released.todo?.state, TodoState.PENDING);
    await refused(Code.FailedPrecondition, () =>
      agent.dispatch.release({ todoId: second.todo!.id, leaseId: second.lease!.leaseId }),
    );
  });

  test("batches: ClaimNext with max_todos, HeartbeatTodos, SettleTodos", { timeout: 60_000 }, async () => {
    for (let i = 0; i < 3; i++) await agent.dispatch.ingest({ queue: { name: "batch" }, payload: bytes(`${i}`) });
    const batch = await agent.dispatch.claimNext({ queues: ["batch"], claimant: "ts", maxTodos: 10 });
    assert.equal(batch.claimed.length, 3);
    assert.equal(batch.todo, undefined);
    const leases = batch.claimed.map((c) => ({ todoId: c.todo!.id, leaseId: c.lease!.leaseId }));

    const beats = await agent.dispatch.heartbeatTodos({
      leases: [...leases, { todoId: NO_SUCH_TODO, leaseId: NO_SUCH_LEASE }],
    });
    assert.deepEqual(
      beats.results.map((r) => r.status),
      [BatchItemStatus.APPLIED, BatchItemStatus.APPLIED, BatchItemStatus.APPLIED, BatchItemStatus.NOT_FOUND],
    );
    await refused(Code.InvalidArgument, () => agent.dispatch.heartbeatTodos({ leases: [] }));

    const settled = await agent.dispatch.settleTodos({
      settlements: [
        { ...leases[0]!, action: { case: "complete", value: {} } },
        { ...leases[1]!, action: { case: "fail", value: { error: "nope" } } },
        { ...leases[2]!, action: { case: "release", value: {} } },
      ],
    });
    assert.deepEqual(
      settled.results.map((r) => [r.status, r.state]),
      [
        [BatchItemStatus.APPLIED, TodoState.DONE],
        [BatchItemStatus.APPLIED, TodoState.PENDING],
        [BatchItemStatus.APPLIED, TodoState.PENDING],
      ],
    );
    await refused(Code.InvalidArgument, () => agent.dispatch.settleTodos({ settlements: [] }));
  });

  test("the largest answers: the largest todo by GetTodo, Claim and ClaimNext, a ListTodos page and a ClaimNext batch of 500 at their limits", { timeout: 120_000 }, async () => {
    // Every text at its limit, each character 4 bytes of UTF-8 (MAX_RECEIVE_BYTES lets them in).
    const wide = (n: number) => "\u{1F600}".repeat(n);
    const contentType = wide(255);
    const claimant = wide(200);
    const error = wide(4096);
    const queue = "q".repeat(64);
    const item = (n: number, payload = new Uint8Array()) => ({
      queue: { name: queue },
      payload,
      contentType,
      dedup: { webhookId: wide(200), deliveryId: `${n}` },
      maxAttempts: 100,
    });
    // WatchReopen's answer, a doorbell, carries no todo: its queue's name (the longest) is
    // its only text of any length.
    const stopWatching = new AbortController();
    let subscribed!: () => void;
    const watching = new Promise<void>((r) => (subscribed = r));
    const bells = agent.dispatch
      .watchReopen({ queues: [queue] }, { signal: stopWatching.signal, onHeader: () => subscribed() })
      [Symbol.asyncIterator]();
    const bell = bells.next();
    await watching;
    const todoId = (await agent.dispatch.ingest(item(-1, new Uint8Array(1024 * 1024).fill(112)))).todo!.id;
    assert.equal((await bell).value?.doorbell?.queue?.name, queue);
    stopWatching.abort();
    await bells.return?.();

    const first = await agent.dispatch.claim({ todoId, claimant });
    await agent.dispatch.fail({ todoId, leaseId: first.lease!.leaseId, error, permanent: true });
    await human.dispatch.requeueTodo({ todoId });
    // The largest todo (its longest error now) by Claim, by ClaimNext alone and in a batch.
    const largest = (todo: Todo | undefined) => {
      assert.ok(todo);
      assert.equal(todo.id, todoId);
      assert.equal(todo.payload.length, 1024 * 1024);
      assert.equal(todo.lastError, error);
      assert.equal(todo.claimant, claimant);
    };
    const byId = await agent.dispatch.claim({ todoId, claimant });
    largest(byId.todo);
    await agent.dispatch.release({ todoId, leaseId: byId.lease!.leaseId });
    const next = await agent.dispatch.claimNext({ queues: [queue], claimant });
    largest(next.todo);
    await agent.dispatch.release({ todoId, leaseId: next.lease!.leaseId });
    const inBatch = await agent.dispatch.claimNext({ queues: [queue], claimant, maxTodos: 2 });
    assert.equal(inBatch.claimed.length, 1);
    largest(inBatch.claimed[0]!.todo);
    const result = { data: new Uint8Array(64 * 1024).fill(114), contentType };
    await agent.dispatch.complete({ todoId, leaseId: inBatch.claimed[0]!.lease!.leaseId, result });
    const got = await agent.dispatch.getTodo({ todoId });
    assert.equal(got.todo!.payload.length, 1024 * 1024);
    assert.equal(got.todo!.lastError, error);
    assert.deepEqual(got.todo!.result!.data, result.data);
    assert.equal(got.todo!.result!.contentType, contentType);
    assert.deepEqual(got.attempts.map((a) => a.error), [error, "", "", ""]);

    for (let start = 0; start < 500; start += 250) {
      const todos = Array.from({ length: 250 }, (_, i) => item(start + i));
      await agent.dispatch.ingestTodos({ todos });
    }
    const batch = await agent.dispatch.claimNext({ queues: [queue], claimant, maxTodos: 500 });
    assert.equal(batch.claimed.length, 500);
    for (let start = 0; start < 500; start += 50) {
      await agent.dispatch.settleTodos({
        settlements: batch.claimed.slice(start, start + 50).map((c) => ({
          todoId: c.todo!.id,
          leaseId: c.lease!.leaseId,
          action: { case: "fail" as const, value: { error, permanent: true } },
        })),
      });
    }
    const page = await agent.dispatch.listTodos({ queues: [queue], states: [TodoState.DEAD], pageSize: 500 });
    assert.equal(page.todos.length, 500);
    assert.ok(page.todos.every((t) => t.lastError === error && t.claimant === claimant));
  });

  test("every RPC of DispatchService, AdmissionService and ScheduleService is called in this file", () => {
    const source = readFileSync(new URL(import.meta.url), "utf8");
    const missing = [...DispatchService.methods, ...AdmissionService.methods, ...ScheduleService.methods]
      .map((m) => m.localName)
      .filter((name) => !source.includes(`.${name}(`));
    assert.deepEqual(missing, []);
  });

  test("CancelTodo, RequeueTodo, CancelTodos, RequeueTodos, ListTodoAudit; and refusals", { timeout: 60_000 }, async () => {
    const a = (await agent.dispatch.ingest({ queue: { name: "ops" }, payload: bytes("a") })).todo!;
    const b = (await agent.dispatch.ingest({ queue: { name: "ops" }, payload: bytes("b") })).todo!;
    // A basics credential has neither the cancel nor the requeue grant; the human has both.
    await refused(Code.PermissionDenied, () => agent.dispatch.cancelTodo({ todoId: a.id }));
    assert.equal((await human.dispatch.cancelTodo({ todoId: a.id })).todo!.state, TodoState.CANCELLED);
    await refused(Code.FailedPrecondition, () => human.dispatch.cancelTodo({ todoId: a.id }));
    await refused(Code.PermissionDenied, () => agent.dispatch.requeueTodo({ todoId: a.id }));
    assert.equal((await human.dispatch.requeueTodo({ todoId: a.id })).todo!.state, TodoState.PENDING);
    await refused(Code.FailedPrecondition, () => human.dispatch.requeueTodo({ todoId: a.id }));

    const cancelled = await human.dispatch.cancelTodos({ todoIds: [a.id, b.id, NO_SUCH_TODO] });
    assert.deepEqual(
      cancelled.results.map((r) => r.status),
      [BulkItemStatus.APPLIED, BulkItemStatus.APPLIED, BulkItemStatus.NOT_FOUND],
    );
    await refused(Code.InvalidArgument, () => human.dispatch.cancelTodos({}));
    const filter = { endpointId: server.endpointId, queues: ["ops"], states: [TodoState.CANCELLED] };
    const counted = await human.dispatch.requeueTodos({ filter, dryRun: true });
    assert.equal(counted.count, 2n);
    const requeued = await human.dispatch.requeueTodos({ filter });
    assert.equal(requeued.count, 2n);
    await refused(Code.PermissionDenied, () => agent.dispatch.requeueTodos({ filter }));

    const audit = await human.dispatch.listTodoAudit({ endpointId: server.endpointId });
    assert.ok(audit.entries.length >= 4, `${audit.entries.length} audit entries`);
    await refused(Code.InvalidArgument, () => human.dispatch.listTodoAudit({ pageSize: 501 }));
  });

  test("WatchReopen rings for a new todo; a bad token is refused; a deadline ends it", { timeout: 60_000 }, async () => {
    const abort = new AbortController();
    let subscribed!: () => void;
    const headers = new Promise<void>((r) => (subscribed = r));
    const stream = agent.dispatch.watchReopen(
      { queues: ["bell"] },
      { signal: abort.signal, onHeader: () => subscribed() },
    );
    const iterator = stream[Symbol.asyncIterator]();
    const first = iterator.next();
    await headers;
    await agent.dispatch.ingest({ queue: { name: "bell" }, payload: bytes("ring") });
    const { value } = await first;
    assert.equal(value?.doorbell?.queue?.name, "bell");
    assert.equal(value?.doorbell?.cause, DoorbellCause.CREATED);
    abort.abort();
    await iterator.return?.();

    await refused(Code.Unauthenticated, async () => {
      for await (const _ of stranger.dispatch.watchReopen({ queues: ["bell"] })) assert.fail("no doorbell");
    });
    // A deadline ends a quiet stream.
    const started = Date.now();
    await refused(Code.DeadlineExceeded, async () => {
      for await (const _ of agent.dispatch.watchReopen({ queues: ["quiet"] }, { timeoutMs: 300 })) {
        assert.fail("no doorbell");
      }
    });
    assert.ok(Date.now() - started < 5_000);
  });

  test("AdmissionService: SetPolicy, GetPolicy, ListPolicyAudit, ClearPolicy; and refusals", { timeout: 60_000 }, async () => {
    const queue = queueRef("governed", server.endpointId);
    const set = await human.admission.setPolicy({ policy: { queue, maxInFlight: 2 } });
    assert.equal(set.policy?.maxInFlight, 2);
    await refused(Code.InvalidArgument, () => human.admission.setPolicy({ policy: { queue } }));

    const got = await human.admission.getPolicy({ queue });
    assert.equal(got.policy?.maxInFlight, 2);
    await refused(Code.NotFound, () =>
      human.admission.getPolicy({ queue: queueRef("ungoverned", server.endpointId) }),
    );

    const audit = await human.admission.listPolicyAudit({ queue });
    assert.deepEqual(
      audit.entries.map((e) => e.action),
      [PolicyAction.SET],
    );
    await refused(Code.InvalidArgument, () => human.admission.listPolicyAudit({ queue, pageSize: 501 }));

    const cleared = await human.admission.clearPolicy({ queue });
    assert.equal(cleared.policy?.maxInFlight, 2);
    await refused(Code.NotFound, () => human.admission.clearPolicy({ queue }));
  });

  test("AdmissionService templates: SetPolicyTemplate, GetPolicyTemplate, ListPolicyTemplates, ListPolicyTemplateAudit, ClearPolicyTemplate", { timeout: 60_000 }, async () => {
    const endpointId = server.endpointId;
    const set = await human.admission.setPolicyTemplate({
      policyTemplate: { endpointId, pattern: "account:*", maxInFlight: 3 },
    });
    assert.equal(set.policyTemplate?.pattern, "account:*");
    assert.equal(set.policyTemplate?.maxInFlight, 3);
    await refused(Code.InvalidArgument, () =>
      human.admission.setPolicyTemplate({ policyTemplate: { endpointId, pattern: "account", maxInFlight: 3 } }),
    );
    // A queue born after the template is governed by it from its first todo.
    await agent.dispatch.ingest({ queue: { name: "account:42" }, payload: bytes("x") });
    const governed = await human.admission.getPolicy({ queue: queueRef("account:42", endpointId) });
    assert.equal(governed.policy?.maxInFlight, 3);
    assert.equal(governed.templatePattern, "account:*");

    const got = await human.admission.getPolicyTemplate({ endpointId, pattern: "account:*" });
    assert.equal(got.policyTemplate?.maxInFlight, 3);
    const listed = await human.admission.listPolicyTemplates({ endpointId });
    assert.deepEqual(listed.policyTemplates.map((t) => t.pattern), ["account:*"]);
    const audit = await human.admission.listPolicyTemplateAudit({ endpointId, pattern: "account:*" });
    assert.deepEqual(audit.entries.map((e) => e.action), [PolicyAction.SET]);

    const cleared = await human.admission.clearPolicyTemplate({ endpointId, pattern: "account:*" });
    assert.equal(cleared.policyTemplate?.pattern, "account:*");
    assert.equal(cleared.queuesChanged, 1);
    await refused(Code.NotFound, () => human.admission.getPolicyTemplate({ endpointId, pattern: "account:*" }));
    await refused(Code.NotFound, () => human.admission.getPolicy({ queue: queueRef("account:42", endpointId) }));
  });

  test("ScheduleService: create, get, list, update, pause, resume, audit, delete; and refusals", { timeout: 60_000 }, async () => {
    const schedule = {
      queue: queueRef("reports", server.endpointId),
      name: "nightly",
      template: { payload: bytes("report"), contentType: "text/plain" },
      recurrence: { timeZone: "America/Los_Angeles", rule: { case: "calendar" as const, value: { period: WindowPeriod.DAY, at: "02:30" } } },
      catchUp: CatchUp.SKIP,
    };
    const made = (await human.schedules.createSchedule({ schedule })).schedule!;
    assert.equal(made.name, "nightly");
    assert.match(made.nextSlotLocal, /T0[23]:[03]0:00-0[78]:00$/);
    const e = await refused(Code.InvalidArgument, () =>
      human.schedules.createSchedule({
        schedule: { ...schedule, name: "bad", recurrence: { timeZone: "UTC", rule: { case: "cron", value: "61 * * * *" } } },
      }),
    );
    assert.deepEqual(e.badRequest?.fieldViolations.map((v) => v.field), ["schedule.recurrence.cron"]);
    // A basics credential reads schedules but may not create them.
    await refused(Code.PermissionDenied, () => agent.schedules.createSchedule({ schedule: { ...schedule, name: "agent" } }));

    assert.equal((await agent.schedules.getSchedule({ id: made.id })).schedule?.id, made.id);
    await refused(Code.NotFound, () => human.schedules.getSchedule({ id: NO_SUCH_TODO }));
    const listed = await human.schedules.listSchedules({ endpointId: server.endpointId });
    assert.deepEqual(listed.schedules.map((s) => s.id), [made.id]);
    await refused(Code.InvalidArgument, () => human.schedules.listSchedules({ pageSize: 501 }));

    const updated = await human.schedules.updateSchedule({
      schedule: { ...schedule, id: made.id, recurrence: { timeZone: "UTC", rule: { case: "cron", value: "0 9 * * 1" } } },
    });
    assert.equal(updated.schedule?.recurrence?.rule.value, "0 9 * * 1");
    await refused(Code.InvalidArgument, () => human.schedules.updateSchedule({ schedule: { id: made.id } }));
    assert.equal((await human.schedules.pauseSchedule({ id: made.id })).schedule?.paused, true);
    await refused(Code.PermissionDenied, () => agent.schedules.pauseSchedule({ id: made.id }));
    assert.equal((await human.schedules.resumeSchedule({ id: made.id })).schedule?.paused, false);
    await refused(Code.PermissionDenied, () => agent.schedules.resumeSchedule({ id: made.id }));

    const audit = await human.schedules.listScheduleAudit({ scheduleId: made.id });
    assert.deepEqual(
      audit.entries.map((x) => x.action),
      [ScheduleAction.RESUME, ScheduleAction.PAUSE, ScheduleAction.UPDATE, ScheduleAction.CREATE],
    );
    await refused(Code.InvalidArgument, () => human.schedules.listScheduleAudit({ scheduleId: "x" }));
    await refused(Code.PermissionDenied, () => agent.schedules.deleteSchedule({ id: made.id }));
    assert.equal((await human.schedules.deleteSchedule({ id: made.id })).schedule?.id, made.id);
    await refused(Code.NotFound, () => human.schedules.deleteSchedule({ id: made.id }));
  });

  test("a deferred Claim decodes to ErrorInfo DEFERRED, the DeferralDetail and RetryInfo", { timeout: 60_000 }, async () => {
    const noon = new Date(Date.now() + 86_400_000);
    noon.setUTCHours(12, 0, 0, 0);
    await harness.setClock(server.id, noon);
    const boundary = new Date(noon);
    boundary.setUTCHours(24, 0, 0, 0);
    const queue = queueRef("budgeted", server.endpointId);
    await human.admission.setPolicy({
      policy: { queue, maxClaimsPerWindow: 1, window: { period: WindowPeriod.DAY, timeZone: "UTC", start: "00:00" } },
    });
    const [a, b] = [
      await agent.dispatch.ingest({ queue: { name: "budgeted" }, payload: bytes("a") }),
      await agent.dispatch.ingest({ queue: { name: "budgeted" }, payload: bytes("b") }),
    ];
    const claimed = await agent.dispatch.claim({ todoId: a.todo!.id, claimant: "ts" });
    assert.equal(claimed.headroom?.windowRemaining, 0);

    const e = await refused(Code.ResourceExhausted, () => agent.dispatch.claim({ todoId: b.todo!.id, claimant: "ts" }));
    assert.ok(isDeferred(e.error));
    assert.equal(e.errorInfo?.reason, "DEFERRED");
    assert.equal(e.errorInfo?.domain, "switchboard");
    assert.equal(e.deferral?.queue?.name, "budgeted");
    assert.equal(e.deferral?.reason, DeferralReason.WINDOW_EXHAUSTED);
    assert.equal(e.deferral?.exact, true);
    assert.equal(e.deferral?.pending, 1n);
    assert.equal(e.nextEligibleAt?.getTime(), boundary.getTime());
    // The retry delay runs from the server's clock (noon) to the boundary: 12 hours.
    assert.ok(e.retryInfo?.retryDelay);
    assert.equal(e.retryDelayMs, durationMs(e.retryInfo.retryDelay));
    const hours = e.retryDelayMs! / 3_600_000;
    assert.ok(hours > 11.9 && hours <= 12, `retry delay ${hours} h`);
    // A deferral is not a failure: the todo is untouched.
    const got = await agent.dispatch.getTodo({ todoId: b.todo!.id });
    assert.equal(got.todo?.state, TodoState.PENDING);
    assert.equal(got.todo?.attempt, 0);
  });

  test("mutual TLS: a client certificate of the server's CA is let in, none is not", { timeout: 60_000 }, async () => {
    const tls = await harness.server({ tls: "mutual" });
    const target = tls.address.replace(/^127\.0\.0\.1:/, "localhost:");
    const mutual = connect({
      target,
      token: tls.endpointToken,
      cacert: tls.ca!,
      cert: tls.clientCert!,
      key: tls.clientKey!,
      timeoutMs: 10_000,
    });
    const anonymous = connect({ target, token: tls.endpointToken, cacert: tls.ca!, timeoutMs: 10_000 });
    const plaintext = connect({ target: tls.address, token: tls.endpointToken, timeoutMs: 10_000 });
    try {
      const { todo } = await mutual.dispatch.ingest({ queue: { name: "secure" }, payload: bytes("x") });
      assert.equal(todo?.state, TodoState.PENDING);
      // The handshake (or, in plaintext, the HTTP/2 preface) fails: no call gets through.
      for (const c of [anonymous, plaintext]) {
        await assert.rejects(c.dispatch.getTodo({ todoId: todo!.id }), (err) => {
          const code = richError(err).code;
          return code === Code.Unavailable || code === Code.Canceled;
        });
      }
      assert.throws(() => connect({ target, cert: tls.clientCert! }), /needs its key/);
    } finally {
      await Promise.all([mutual, anonymous, plaintext].map((c) => c.close()));
    }
  });
});
