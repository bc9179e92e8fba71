/**
 * The worker contract: every scenario of tests/contract/worker_scenarios.json (its format in
 * tests/contract/README.md), run with the TypeScript worker against real server processes, as
 * tests/grpc/test_worker_contract.py runs it with the Python worker. RPCs are counted on the
 * worker's transport (an interceptor), held claims on the servers' `/metrics`, todos through
 * the API; the shared clock is moved through the harness.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import type { Interceptor } from "@connectrpc/connect";

import {
  PermanentFailure,
  TodoState,
  Worker,
  WindowPeriod,
  connect,
  queueRef,
  type Connection,
  type Todo,
  type WorkerOptions,
  type WorkerStats,
} from "../src/index.js";
import { Harness, ROOT, quiet, sleep, type ServerInfo } from "./harness.js";

type Json = Record<string, any>;

const TABLE = JSON.parse(readFileSync(join(ROOT, "tests", "contract", "worker_scenarios.json"), "utf8")) as Json;
/** How long a trigger may take when the scenario gives no `within_ms`. */
const DEFAULT_WITHIN_MS = 20_000;

/** The scenario's handler: what it does per todo, and what it saw. */
class ScriptedHandler {
  started = 0;
  finished = 0;
  cancelled = 0;
  running_max = 0;
  readonly running = new Map<string, Todo>();
  /** The todos whose handlers returned or threw, in order. */
  readonly done: string[] = [];

  constructor(private readonly spec: Json) {}

  action(todo: Todo): string {
    const payload = new TextDecoder().decode(todo.payload);
    const byPayload = (this.spec.by_payload ?? {}) as Record<string, string>;
    const byAttempt = (this.spec.by_attempt ?? {}) as Record<string, string>;
    return byPayload[payload] ?? byAttempt[String(todo.attempt)] ?? (this.spec.do as string);
  }

  /** A failure's message: `sentence`, or `error_chars` euro signs. */
  error(sentence: string): string {
    const chars = this.spec.error_chars as number | undefined;
    return chars === undefined ? sentence : "\u20ac".repeat(chars);
  }

  readonly handle = async (todo: Todo, signal: AbortSignal): Promise<void> => {
    this.started += 1;
    this.running.set(todo.id, todo);
    this.running_max = Math.max(this.running_max, this.running.size);
    const aborted = new Promise<void>((resolve) => signal.addEventListener("abort", () => resolve()));
    try {
      const action = this.action(todo);
      await Promise.race([sleep(this.spec.sleep_ms ?? 0), aborted]);
      if (!signal.aborted && action === "hang") await aborted;
      if (signal.aborted) {
        this.cancelled += 1;
        return; // gives up: the worker already stopped waiting for it
      }
      this.finished += 1;
      this.done.push(todo.id);
      if (action === "fail") throw new Error(this.error("the scenario fails this attempt"));
      if (action === "fail_permanently") throw new PermanentFailure(this.error("the scenario fails this todo for good"));
      assert.equal(action, "complete");
    } finally {
      this.running.delete(todo.id);
    }
  };
}

/** One scenario's servers, tenant, worker and observers. */
interface Run {
  servers: Array<{ id: number; httpAddress: string }>;
  primary: ServerInfo;
  agents: Connection[];
  humans: Connection[];
  handler: ScriptedHandler;
  calls: Map<string, number>;
  worker: Worker;
  run: Promise<void>;
  done: boolean;
}

function agentOf(r: Run, step: Json): Connection {
  return r.agents[step.replica ?? 0]!;
}

async function heldClaims(r: Run): Promise<number> {
  let total = 0;
  for (const server of r.servers) {
    const text = await (await fetch(`http://${server.httpAddress}/metrics`)).text();
    for (const m of text.matchAll(/^switchboard_held_claims(?:\{.*\})? (\S+)$/gm)) total += Number(m[1]);
  }
  return total;
}

async function todos(r: Run) {
  const got = [];
  let pageToken = "";
  for (;;) {
    const page = await r.agents[0]!.dispatch.listTodos({ pageSize: 500, pageToken });
    got.push(...page.todos);
    pageToken = page.nextPageToken;
    if (!pageToken) return got;
  }
}

// ------------------------------------------------------------------ set-up and events

async function ingest(r: Run, step: Json): Promise<void> {
  for (let i = 0; i < (step.count ?? 1); i++) {
    await agentOf(r, step).dispatch.ingest({
      queue: { name: step.queue },
      payload: new TextEncoder().encode(String(i)),
      ...(step.max_attempts !== undefined && { maxAttempts: step.max_attempts }),
    });
  }
}

async function policy(r: Run, step: Json): Promise<void> {
  assert.equal(step.window ?? "day", "day");
  await r.humans[step.replica ?? 0]!.admission.setPolicy({
    policy: {
      queue: queueRef(step.queue, r.primary.endpointId),
      ...(step.max_in_flight !== undefined && { maxInFlight: step.max_in_flight }),
      ...(step.max_claims_per_window !== undefined && {
        maxClaimsPerWindow: step.max_claims_per_window,
        window: { period: WindowPeriod.DAY, timeZone: "UTC", start: "00:00" },
      }),
    },
  });
}

async function claim(r: Run, step: Json): Promise<void> {
  const got = await agentOf(r, step).dispatch.claimNext({ queues: [step.queue], claimant: "rival" });
  if (step.expect_claimed !== undefined) assert.equal(got.empty ? 0 : 1, step.expect_claimed, JSON.stringify(got));
}

async function cancelTodos(r: Run, step: Json, todoIds: string[]): Promise<void> {
  for (const todoId of todoIds) await r.humans[step.replica ?? 0]!.dispatch.cancelTodo({ todoId });
}

async function stop(r: Run, step: Json): Promise<void> {
  r.worker.stop();
  if (step.returns_within_ms !== undefined) await within(r.run, step.returns_within_ms, "the run's return after stop");
}

const ACTIONS: Record<string, (r: Run, step: Json) => Promise<void>> = {
  ingest,
  set_policy: policy,
  claim,
  cancel_running: (r, step) => cancelTodos(r, step, [...r.handler.running.keys()]),
  cancel_finished: (r, step) => cancelTodos(r, step, [...r.handler.done]),
  move_clock: async (r, step) => void (await harness.moveClock(r.primary.id, step.seconds)),
  stop,
  check: (r, step) => expect(r, step),
};
const SETUP: Record<string, (r: Run, step: Json) => Promise<void>> = { ingest, policy, claim };

/** Waits until every condition of `after` holds, then `then_ms` more. */
async function trigger(r: Run, cond: Json): Promise<void> {
  const deadline = Date.now() + (cond.within_ms ?? DEFAULT_WITHIN_MS);
  for (;;) {
    const met =
      r.handler.started >= (cond.started ?? 0) &&
      r.handler.finished >= (cond.finished ?? 0) &&
      (cond.held_claims === undefined || (await heldClaims(r)) >= cond.held_claims);
    if (met) break;
    if (r.done) {
      await r.run; // rejects with what ended the run
      assert.fail(`the run ended before ${JSON.stringify(cond)}`);
    }
    assert.ok(Date.now() < deadline, `not met in time: ${JSON.stringify(cond)}`);
    await sleep(50);
  }
  await sleep(cond.then_ms ?? 0);
}

/** `promise`, or a failure after `ms`. */
async function within<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: not within ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([promise, late]);
  } finally {
    clearTimeout(timer);
  }
}

// ------------------------------------------------------------------ expectations

function bounded(value: number, bounds: Json, what: string): void {
  assert.ok(
    (bounds.min ?? value) <= value && value <= (bounds.max ?? value),
    `${what}: ${value} not within ${JSON.stringify(bounds)}`,
  );
}

/** Checks `todos`, `attempts`, `handler`, `outcomes`, `rpcs` and `held_claims`. */
async function expect(r: Run, what: Json): Promise<void> {
  if (what.todos !== undefined) {
    const states: Record<string, number> = {};
    for (const t of await todos(r)) {
      const name = TodoState[t.state]!.toLowerCase();
      states[name] = (states[name] ?? 0) + 1;
    }
    const want = Object.fromEntries(Object.entries(what.todos as Record<string, number>).filter(([, n]) => n));
    assert.deepEqual(states, want, "todos by state");
  }
  if (what.attempts !== undefined) {
    const attempts = (await todos(r)).map((t) => t.attempt).filter((a) => a > 0);
    assert.ok(attempts.length > 0, "no todo was claimed");
    bounded(Math.min(...attempts), what.attempts, "attempts (min)");
    bounded(Math.max(...attempts), what.attempts, "attempts (max)");
  }
  for (const [name, value] of Object.entries((what.handler ?? {}) as Record<string, number>)) {
    assert.equal(r.handler[name as "started"], value, `handler ${name}`);
  }
  for (const [name, value] of Object.entries((what.outcomes ?? {}) as Record<string, number>)) {
    // The Python helper's counter names, in camel case: dead_lettered is deadLettered.
    const key = name.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase()) as keyof WorkerStats;
    assert.equal(r.worker.stats[key], value, `worker stats ${name}: ${JSON.stringify(r.worker.stats)}`);
  }
  for (const [method, bounds] of Object.entries((what.rpcs ?? {}) as Record<string, Json>)) {
    bounded(r.calls.get(method) ?? 0, bounds, `${method} calls (${JSON.stringify(Object.fromEntries(r.calls))})`);
  }
  if (what.held_claims !== undefined) {
    const deadline = Date.now() + 5000;
    let held: number;
    while ((held = await heldClaims(r)) !== what.held_claims) {
      assert.ok(Date.now() < deadline, `held claims: ${held}`);
      await sleep(50);
    }
  }
}

/** The worker spec as `Worker` options (the Python keywords, in camel case). */
function workerOptions(spec: Json): Partial<WorkerOptions> {
  const names: Record<string, keyof WorkerOptions> = {
    queues: "queues",
    prefetch: "prefetch",
    concurrency: "concurrency",
    settle_batch: "settleBatch",
    lease_ms: "leaseMs",
    heartbeat_ms: "heartbeatEveryMs",
    max_idle_wait_ms: "maxIdleWaitMs",
    shutdown_grace_ms: "shutdownGraceMs",
    settle_linger_ms: "settleLingerMs",
    rpc_timeout_ms: "rpcTimeoutMs",
  };
  const options: Record<string, unknown> = {};
  for (const [key, value] of Object.entries(spec)) {
    const name = names[key];
    assert.ok(name, `unknown worker option ${key}`);
    options[name] = value;
  }
  return options as Partial<WorkerOptions>;
}

// ------------------------------------------------------------------ the runner

let harness: Harness;

describe("the worker contract (tests/contract/worker_scenarios.json)", () => {
  before(async () => {
    assert.equal(TABLE.version, 1, "a contract version this runner does not know");
    harness = await Harness.start();
  });

  after(async () => {
    await harness?.close();
  });

  for (const scenario of TABLE.scenarios as Json[]) {
    test(scenario.name, { timeout: 120_000 }, async () => {
      const env = { ...TABLE.servers.env, ...(scenario.env ?? {}) } as Record<string, string>;
      const primary = await harness.server({ env });
      const servers = [{ id: primary.id, address: primary.address, httpAddress: primary.httpAddress }];
      for (let i = 1; i < (scenario.replicas ?? 1); i++) servers.push(await harness.replica(primary.id));
      const agents = servers.map((s) => connect({ target: s.address, token: primary.endpointToken, timeoutMs: 10_000 }));
      const humans = servers.map((s) => connect({ target: s.address, token: primary.humanToken, timeoutMs: 10_000 }));
      const calls = new Map<string, number>();
      const count: Interceptor = (next) => (req) => {
        calls.set(req.method.name, (calls.get(req.method.name) ?? 0) + 1);
        return next(req);
      };
      const channel = connect({ target: primary.address, interceptors: [count] });
      try {
        const handler = new ScriptedHandler(scenario.handler);
        const r = { servers, primary, agents, humans, handler, calls, done: false } as Partial<Run> as Run;
        for (const step of scenario.setup as Json[]) {
          const [[kind, args]] = Object.entries(step) as [[string, Json]];
          await SETUP[kind]!(r, args);
        }
        r.worker = new Worker({
          transport: channel.transport,
          token: primary.endpointToken,
          handler: handler.handle,
          claimant: "contract",
          log: quiet,
          ...workerOptions(scenario.worker),
        });
        const spec = scenario.run as Json;
        r.run = r.worker.run({ maxTodos: spec.max_todos, stopWhenIdle: spec.until_idle ?? false });
        r.run.then(
          () => (r.done = true),
          () => (r.done = true),
        );
        try {
          for (const event of scenario.events as Json[]) {
            if (event.after !== undefined) await trigger(r, event.after);
            await ACTIONS[event.do]!(r, event);
          }
          await within(r.run, spec.within_ms, "the run");
        } finally {
          if (!r.done) {
            r.worker.stop();
            await within(r.run, 10_000, "the run after stop").catch(() => {});
          }
        }
        await expect(r, scenario.expect);
      } finally {
        await Promise.all([channel, ...agents, ...humans].map((c) => c.close({ graceMs: 0 })));
        for (const s of [...servers].reverse()) await harness.kill(s.id);
      }
    });
  }
});
