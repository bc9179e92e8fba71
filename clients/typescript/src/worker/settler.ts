/**
 * The settler: sends the outcomes of finished handlers, batched and retried.
 *
 * {@link Settler} sends the waiting settlements when `settleBatch` of them wait, when the oldest
 * has waited `settleLingerMs`, when no handler is running any more, or at once after
 * {@link Settler.flush} (stop): one by one with `Complete`, `Fail` or `Release` when
 * `concurrency` is 1, else in `SettleTodos` batches. A batch larger than the server takes in one
 * request (`MAX_BATCH_BYTES` of encoded settlements) is sent as several calls at once, each
 * within it ({@link bySize}). Transient errors are retried while the leases last; each outcome
 * is counted in `stats` by its result (and told as a `settled` event), and its todo leaves the
 * held todos.
 */
import { toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";

import {
  BatchItemStatus,
  SettlementSchema,
  type Settlement,
  type SettlementResult,
} from "../gen/switchboard/v1/dispatch_pb.js";
import { TodoState } from "../gen/switchboard/v1/todo_pb.js";
import {
  LEASE_LOST_CODES,
  MAX_BATCH,
  MAX_BATCH_BYTES,
  TRANSIENT_CODES,
  describe,
  now,
  wasCancelled,
  type Notify,
  type WorkerLogger,
} from "./common.js";
import { Backoff, Flag, waitFor } from "./flags.js";
import type { Held, HeldTodos } from "./held.js";
import type { CallOptions, Rpc } from "./rpc.js";
import type { WorkerStats } from "./stats.js";

/** The states a settlement leaves its todo in: a retried item refused as NOT_CLAIMED with its
 * todo in one of them was applied by the try whose answer was lost. */
const SETTLED_STATES: Record<string, ReadonlySet<TodoState>> = {
  complete: new Set([TodoState.DONE]),
  fail: new Set([TodoState.PENDING, TodoState.DEAD]),
  release: new Set([TodoState.PENDING, TodoState.DEAD]),
};

/**
 * `batch` cut, in order, into runs whose settlements come to at most `budget` bytes of
 * `SettleTodosRequest` each; a settlement larger than that alone (none is: the largest carries an
 * error text of 4096 characters) gets a run of its own, so the others still fit.
 */
export function bySize(batch: Held[], budget: number = MAX_BATCH_BYTES): Held[][] {
  const runs: Held[][] = [];
  let size = 0;
  for (const held of batch) {
    const body = held.settlement ? toBinary(SettlementSchema, held.settlement).length : 0;
    const item = 1 + Math.ceil(body.toString(2).length / 7) + body; // tag, length, body
    const last = runs[runs.length - 1];
    if (last && size + item <= budget) {
      last.push(held);
      size += item;
    } else {
      runs.push([held]);
      size = item;
    }
  }
  return runs;
}

/** Sends the settlements of finished handlers (see the module docs). */
export class Settler {
  /** Finished, waiting for their settlement to be sent (oldest first). */
  #ready: Held[] = [];
  readonly #arrived = new Flag();
  readonly #flushNow = new Flag();

  constructor(
    private readonly rpc: Rpc,
    private readonly held: HeldTodos,
    private readonly stats: WorkerStats,
    private readonly log: WorkerLogger,
    private readonly notify: Notify,
    private readonly options: { oneByOne: boolean; batch: number; lingerMs: number },
  ) {}

  /** Queues a finished handler's settlement (`held.settlement`). */
  submit(held: Held): void {
    this.#ready.push(held);
    this.#arrived.set();
  }

  /** Takes back a settlement not sent yet (its lease was lost meanwhile). */
  withdraw(held: Held): void {
    this.#ready = this.#ready.filter((h) => h !== held);
  }

  /** Sends what waits at once, and from now on without lingering (stop). */
  flush(): void {
    this.#flushNow.set();
  }

  /** Forgets what waits (the end of a run). */
  reset(): void {
    this.#ready = [];
    this.#flushNow.clear();
  }

  /** Sends settlements as they become due, until `ending` is set. */
  async run(ending: Flag): Promise<void> {
    while (!ending.isSet) {
      if (this.#ready.length === 0) {
        this.#arrived.clear();
        await waitFor(null, this.#arrived, ending);
        continue;
      }
      const wait = this.#flushWait();
      if (wait > 0) {
        this.#arrived.clear();
        await waitFor(wait, this.#arrived, this.#flushNow, ending);
        continue;
      }
      // One turn of the event loop first, so handlers that finish in this turn (timers due
      // together, promises settled together) join the batch, as in an asyncio loop.
      await new Promise<void>((resolve) => setImmediate(resolve));
      const batch = this.#ready.splice(0, MAX_BATCH);
      if (batch.length === 0) continue; // withdrawn meanwhile
      for (const held of batch) held.settling = true;
      if (this.options.oneByOne) {
        for (const held of batch) await this.#settleOne(held, ending);
      } else {
        await Promise.all(bySize(batch).map((part) => this.#settleMany(part, ending)));
      }
    }
  }

  /** Milliseconds until the waiting settlements are due (0 or less: now). */
  #flushWait(): number {
    if (this.#ready.length >= this.options.batch || this.#flushNow.isSet || this.held.allFinished()) return 0;
    return this.#ready[0]!.finishedAt + this.options.lingerMs - now();
  }

  #count(settlement: Settlement): void {
    const action = settlement.action;
    if (action.case === "complete") {
      this.stats.completed += 1;
      this.notify.settled(settlement.todoId, "completed");
    } else if (action.case === "fail") {
      this.stats.failed += 1;
      if (action.value.permanent) this.stats.deadLettered += 1;
      this.notify.settled(settlement.todoId, "failed", action.value);
    } else {
      this.stats.released += 1;
      this.notify.settled(settlement.todoId, "released");
    }
  }

  /** Settles one todo with `Complete`, `Fail` or `Release`. */
  async #settleOne(held: Held, ending: Flag): Promise<void> {
    const s = held.settlement!;
    const ref = { todoId: s.todoId, leaseId: s.leaseId };
    const client = this.rpc.client;
    let ok: boolean;
    if (s.action.case === "complete") {
      ok = await this.#settle(held, "Complete", (o) => client.complete(ref, o), ending);
    } else if (s.action.case === "fail") {
      const { error, permanent } = s.action.value;
      ok = await this.#settle(held, "Fail", (o) => client.fail({ ...ref, error, permanent }, o), ending);
    } else {
      ok = await this.#settle(held, "Release", (o) => client.release(ref, o), ending);
    }
    if (ok) this.#count(s);
    this.held.forget(held);
  }

  /** Completes, fails or releases, retrying transient errors while the lease lasts. */
  async #settle(
    held: Held,
    name: "Complete" | "Fail" | "Release",
    call: (options: CallOptions) => Promise<unknown>,
    ending: Flag,
  ): Promise<boolean> {
    const backoff = new Backoff(100, 5000);
    for (;;) {
      let delay: number;
      try {
        await this.rpc.unary(name, call);
        return true;
      } catch (err) {
        const e = ConnectError.from(err);
        if (LEASE_LOST_CODES.has(e.code)) {
          this.#refused(held, name, e.rawMessage, wasCancelled(e));
          return false;
        }
        const remaining = held.expires - now();
        if (!TRANSIENT_CODES.has(e.code) || remaining <= 0 || ending.isSet) {
          this.stats.unsettled += 1;
          this.log.error(`${name} of todo ${held.todoId} failed (${describe(e)}); the lease will lapse`);
          this.notify.error(e, { rpc: name, retrying: false, todoIds: [held.todoId] });
          this.notify.settled(held.todoId, "unsettled");
          return false;
        }
        this.notify.error(e, { rpc: name, retrying: true, todoIds: [held.todoId] });
        delay = Math.min(backoff.next(), remaining);
        this.log.warn(`${name} failed (${Code[e.code]}); retrying in ${(delay / 1000).toFixed(1)}s`);
      }
      await waitFor(delay, ending);
    }
  }

  /** Settles `batch` with `SettleTodos`, retrying transient errors while the leases last. */
  async #settleMany(batch: Held[], ending: Flag): Promise<void> {
    const backoff = new Backoff(100, 5000);
    let retried = false;
    let results: Map<string, SettlementResult>;
    for (;;) {
      let delay: number;
      try {
        const settlements = batch.map((h) => h.settlement!);
        const response = await this.rpc.unary("SettleTodos", (o) => this.rpc.client.settleTodos({ settlements }, o));
        results = new Map(response.results.map((r) => [r.todoId, r]));
        break;
      } catch (err) {
        const e = ConnectError.from(err);
        const t = now();
        const transient = TRANSIENT_CODES.has(e.code) && !ending.isSet;
        const todoIds = batch.map((h) => h.todoId);
        for (const held of batch.filter((h) => !transient || h.expires <= t)) {
          this.stats.unsettled += 1;
          this.log.error(`settling todo ${held.todoId} failed (${describe(e)}); the lease will lapse`);
          batch = batch.filter((h) => h !== held);
          this.held.forget(held);
          this.notify.settled(held.todoId, "unsettled");
        }
        this.notify.error(e, { rpc: "SettleTodos", retrying: batch.length > 0, todoIds });
        if (batch.length === 0) return;
        delay = Math.min(backoff.next(), Math.max(...batch.map((h) => h.expires)) - t);
        this.log.warn(
          `SettleTodos of ${batch.length} todos failed (${Code[e.code]}); retrying in ${(delay / 1000).toFixed(1)}s`,
        );
        // The failed call may have been applied: its items then come back refused.
        retried = true;
      }
      await waitFor(delay, ending);
    }
    for (const held of batch) {
      this.#settled(held, results.get(held.todoId), retried);
      this.held.forget(held);
    }
  }

  /** Counts one item of a `SettleTodos` answer. */
  #settled(held: Held, result: SettlementResult | undefined, retried: boolean): void {
    const s = held.settlement!;
    const action = s.action.case ?? "";
    if (result?.status === BatchItemStatus.APPLIED) {
      this.#count(s);
      return;
    }
    if (retried && result?.status === BatchItemStatus.NOT_CLAIMED && SETTLED_STATES[action]?.has(result.state)) {
      this.log.info(`todo ${held.todoId} was settled by an earlier try of the same call`);
      this.#count(s);
      return;
    }
    this.#refused(
      held,
      action,
      result ? result.message : "missing from the answer",
      result?.state === TodoState.CANCELLED,
    );
  }

  /** A settlement refused for a stale lease: the todo is lost (or was cancelled), never retried. */
  #refused(held: Held, action: string, why: string, cancelled: boolean): void {
    held.lost = true;
    held.cancelled = cancelled;
    if (cancelled) {
      this.stats.cancelled += 1;
      this.log.info(`${action} of todo ${held.todoId} refused: the todo was cancelled`);
      this.notify.settled(held.todoId, "cancelled");
      return;
    }
    this.stats.lost += 1;
    this.log.warn(`${action} of todo ${held.todoId} refused: the lease is stale (${why})`);
    this.notify.settled(held.todoId, "lost");
  }
}
