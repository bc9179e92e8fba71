/**
 * {@link Worker}: claims todos and runs a handler on each, heartbeats their leases, settles
 * their outcomes in batches, and sleeps on doorbells when idle. The same semantics as the
 * Python `switchboard.worker.Worker` (see the package README for the two side by side).
 */
import { create } from "@bufbuild/protobuf";
import { timestampMs } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError, createClient, type Client, type Transport } from "@connectrpc/connect";

import type { DeferredQueue } from "../gen/switchboard/v1/admission_pb.js";
import {
  BatchItemStatus,
  ClaimNextResponseSchema,
  DispatchService,
  SettlementSchema,
  WatchReopenResponseSchema,
  type ClaimNextResponse,
  type ClaimedTodo,
  type Doorbell,
  type Settlement,
  type SettlementResult,
} from "../gen/switchboard/v1/dispatch_pb.js";
import { TodoState, type Lease, type Todo } from "../gen/switchboard/v1/todo_pb.js";
import { jsonable } from "../json.js";
import { WorkerEvents } from "./events.js";
import { Backoff, Flag, waitFor } from "./flags.js";
import { WorkerStats, type WorkerRpc } from "./stats.js";

/** Most todos one `ClaimNext` may claim, and most items of a batch call (the server's limit). */
export const MAX_BATCH = 500;

/**
 * Codes worth retrying: the server or the network may answer differently later.
 * `Canceled` too: a server that stops cancels the calls it has in flight (the
 * worker's own stop ends its loops before any retry).
 */
export const TRANSIENT_CODES: ReadonlySet<Code> = new Set([
  Code.Unavailable,
  Code.Canceled,
  Code.DeadlineExceeded,
  Code.Aborted,
  Code.ResourceExhausted,
  Code.Internal,
  Code.Unknown,
]);

/** Codes that mean the lease is no longer ours (taken over, reaped, or the todo is gone). */
const LEASE_LOST_CODES: ReadonlySet<Code> = new Set([Code.FailedPrecondition, Code.NotFound]);

/** Per-item refusals of a batch call: the lease is no longer ours. */
const REFUSED: ReadonlySet<BatchItemStatus> = new Set([
  BatchItemStatus.STALE_LEASE,
  BatchItemStatus.NOT_CLAIMED,
  BatchItemStatus.NOT_FOUND,
]);

/** The states a settlement leaves its todo in: a retried item refused as NOT_CLAIMED with its
 * todo in one of them was applied by the try whose answer was lost. */
const SETTLED_STATES: Record<string, ReadonlySet<TodoState>> = {
  complete: new Set([TodoState.DONE]),
  fail: new Set([TodoState.PENDING, TodoState.DEAD]),
  release: new Set([TodoState.PENDING, TodoState.DEAD]),
};

/** A `WatchReopen` stream that lived this long was healthy: reconnect quickly after it. */
const HEALTHY_STREAM_MS = 10_000;

/** The server cuts `Fail` error texts at this length; the worker does it first. */
const MAX_ERROR_TEXT = 4096;

/** Marks a {@link PermanentFailure} of either build of the package (ESM or CommonJS). */
const PERMANENT: unique symbol = Symbol.for("@switchboard/client.PermanentFailure");

/** Thrown by a handler to dead-letter its todo instead of having it retried. */
export class PermanentFailure extends Error {
  override name = "PermanentFailure";

  /**
   * `instanceof PermanentFailure` holds for one made by the package's other build too (an
   * application that both imports and requires the package loads two copies of the class).
   */
  static override [Symbol.hasInstance](value: unknown): boolean {
    if (this !== PermanentFailure) return Function.prototype[Symbol.hasInstance].call(this, value);
    return value instanceof Error && (value as { [PERMANENT]?: unknown })[PERMANENT] === true;
  }
}
Object.defineProperty(PermanentFailure.prototype, PERMANENT, { value: true });

/**
 * Does the work of one todo. Throw {@link PermanentFailure} to dead-letter it, anything else to
 * fail it (retried after the server's backoff). `signal` aborts when the lease is lost or the
 * shutdown grace runs out: the worker stops waiting for the handler then.
 */
export type Handler = (todo: Todo, signal: AbortSignal) => Promise<void>;

/** Where the worker's log lines go (`console` by default: warnings and errors only). */
export interface WorkerLogger {
  debug(message: string): void;
  info(message: string): void;
  warn(message: string): void;
  error(message: string): void;
}

const defaultLogger: WorkerLogger = {
  debug: () => {},
  info: () => {},
  warn: (m) => console.warn(`switchboard.worker: ${m}`),
  error: (m) => console.error(`switchboard.worker: ${m}`),
};

/** A worker's settings (the Python helper's, in milliseconds). */
export interface WorkerOptions {
  /** A transport to the server (`connect(...).transport`); owned by the caller. */
  transport: Transport;
  /** Sent as `authorization: Bearer <token>` (leave out when the transport adds it). */
  token?: string | undefined;
  handler: Handler;
  /** The endpoint to draw from; empty means the credential's own. */
  endpointId?: string | undefined;
  /** Only these queues of the endpoint (all of them when empty). */
  queues?: string[] | undefined;
  /** The worker's name, recorded on each claim (at most 200 characters). */
  claimant: string;
  /** The lease asked for on claim and every heartbeat: 1 s to 24 h; default 5 minutes. */
  leaseMs?: number | undefined;
  /** How often to extend the leases held; default a third of the lease. */
  heartbeatEveryMs?: number | undefined;
  /** The longest wait without a doorbell before claiming again; default 5 minutes. */
  maxIdleWaitMs?: number | undefined;
  /** How long a stop lets running handlers finish; default 30 s. */
  shutdownGraceMs?: number | undefined;
  /** The deadline of each unary RPC; default 30 s. */
  rpcTimeoutMs?: number | undefined;
  /** The most todos one `ClaimNext` claims (1 to 500; default 1). */
  prefetch?: number | undefined;
  /** The most handlers at once, also the most todos held (prefetch to 500; default prefetch). */
  concurrency?: number | undefined;
  /** Send a `SettleTodos` once this many outcomes wait; default the refill size. */
  settleBatch?: number | undefined;
  /** The longest an outcome waits for others to join its `SettleTodos`; default 50 ms. */
  settleLingerMs?: number | undefined;
  log?: WorkerLogger | undefined;
}

/** How {@link Worker.run} ends. */
export interface RunOptions {
  /** Return after this many todos were claimed and settled. */
  maxTodos?: number | undefined;
  /** Return the first time `ClaimNext` finds nothing claimable, once the todos held are settled. */
  stopWhenIdle?: boolean | undefined;
  /** Aborting it stops the worker as {@link Worker.stop} does. */
  signal?: AbortSignal | undefined;
}

/** A claimed todo, from its claim until it is settled (or its lease is lost). */
interface Held {
  todoId: string;
  leaseId: string;
  /** Local monotonic time the lease runs out (as far as this worker knows). */
  expires: number;
  /** Local monotonic time the lease was last granted or extended. */
  extendedAt: number;
  /** Aborts the handler. */
  abort: AbortController;
  /** Set once the handler's outcome is known (or it was abandoned). */
  handled: boolean;
  settlement?: Settlement;
  finishedAt: number;
  /** Set once its settlement is being sent: heartbeats leave it alone from then on. */
  settling: boolean;
  /** Set when the server said the lease is stale. */
  lost: boolean;
}

const now = () => performance.now();

function errorText(err: unknown): string {
  let text: string;
  if (err instanceof Error) text = err.message ? `${err.name}: ${err.message}` : err.name;
  else text = String(err);
  return text.slice(0, MAX_ERROR_TEXT);
}

function describe(err: unknown): string {
  const e = ConnectError.from(err);
  return `${Code[e.code]}: ${e.rawMessage}`;
}

/**
 * Claims todos and runs `handler` on each; see the package README for the whole behaviour:
 * batches (`prefetch`, `concurrency`), heartbeats, settlement batches, deferrals and doorbells,
 * failures and shutdown. Emits `claimed`, `doorbell`, `settled`, `deferred` and `error`
 * ({@link WorkerEvents}).
 */
export class Worker extends WorkerEvents {
  readonly endpointId: string;
  readonly queues: readonly string[];
  readonly claimant: string;
  readonly leaseMs: number;
  readonly heartbeatEveryMs: number;
  readonly maxIdleWaitMs: number;
  readonly shutdownGraceMs: number;
  readonly rpcTimeoutMs: number;
  readonly prefetch: number;
  readonly concurrency: number;
  readonly settleBatch: number;
  readonly settleLingerMs: number;

  /** Counters of what the worker did. */
  readonly stats = new WorkerStats();
  /** The deferred queues of the last `ClaimNext` (empty answer: all; cut-short batch: its queue). */
  lastDeferred: DeferredQueue[] = [];
  /** The last doorbell received, if any. */
  lastDoorbell: Doorbell | undefined;
  /** Set while the `WatchReopen` stream is subscribed. */
  readonly watching = new Flag();

  readonly #client: Client<typeof DispatchService>;
  readonly #headers: Record<string, string>;
  readonly #handler: Handler;
  readonly #log: WorkerLogger;
  readonly #refill: number;

  #running = false;
  #earlyWakes = 0;
  readonly #stopping = new Flag();
  readonly #bell = new Flag();
  /** Set when the run is over: the helper loops return. */
  #ending = new Flag();
  #endingAbort = new AbortController();

  /** Claimed and not yet settled (or lost), by todo id. */
  readonly #held = new Map<string, Held>();
  /** Finished, waiting for their settlement to be sent (oldest first). */
  #ready: Held[] = [];
  readonly #added = new Flag();
  readonly #freed = new Flag();
  readonly #finished = new Flag();
  readonly #flushNow = new Flag();

  constructor(options: WorkerOptions) {
    super();
    const lease = options.leaseMs ?? 300_000;
    if (!(lease >= 1000 && lease <= 86_400_000)) {
      throw new RangeError(`leaseMs must be between 1 second and 24 hours, got ${lease}`);
    }
    const beat = options.heartbeatEveryMs ?? lease / 3;
    if (!(beat > 0 && beat < lease)) {
      throw new RangeError(`heartbeatEveryMs must be positive and shorter than the lease (${lease})`);
    }
    const idle = options.maxIdleWaitMs ?? 300_000;
    if (!(idle > 0)) throw new RangeError("maxIdleWaitMs must be positive");
    const grace = options.shutdownGraceMs ?? 30_000;
    if (!(grace >= 0)) throw new RangeError("shutdownGraceMs must not be negative");
    const timeout = options.rpcTimeoutMs ?? 30_000;
    if (!(timeout > 0)) throw new RangeError("rpcTimeoutMs must be positive");
    const prefetch = options.prefetch ?? 1;
    if (!(Number.isInteger(prefetch) && prefetch >= 1 && prefetch <= MAX_BATCH)) {
      throw new RangeError(`prefetch must be between 1 and ${MAX_BATCH}, got ${prefetch}`);
    }
    const slots = options.concurrency ?? prefetch;
    if (!(Number.isInteger(slots) && slots >= prefetch && slots <= MAX_BATCH)) {
      throw new RangeError(
        `concurrency must be between prefetch (${prefetch}) and ${MAX_BATCH}, got ${slots}: ` +
          "the worker only claims todos it has handler slots for",
      );
    }
    const refill = Math.max(1, Math.min(prefetch, Math.floor(slots / 2)));
    const flushAt = options.settleBatch ?? refill;
    if (!(Number.isInteger(flushAt) && flushAt >= 1 && flushAt <= MAX_BATCH)) {
      throw new RangeError(`settleBatch must be between 1 and ${MAX_BATCH}, got ${flushAt}`);
    }
    const linger = options.settleLingerMs ?? 50;
    if (!(linger >= 0)) throw new RangeError("settleLingerMs must not be negative");
    if (!options.claimant) throw new RangeError("claimant is required");

    this.#client = createClient(DispatchService, options.transport);
    this.#headers = options.token ? { authorization: `Bearer ${options.token}` } : {};
    this.#handler = options.handler;
    this.#log = options.log ?? defaultLogger;
    this.listenerErrorLog = (message) => this.#log.error(message);
    this.endpointId = options.endpointId ?? "";
    this.queues = [...(options.queues ?? [])];
    this.claimant = options.claimant;
    this.leaseMs = lease;
    this.heartbeatEveryMs = beat;
    this.maxIdleWaitMs = idle;
    this.shutdownGraceMs = grace;
    this.rpcTimeoutMs = timeout;
    this.prefetch = prefetch;
    this.concurrency = slots;
    this.settleBatch = flushAt;
    this.settleLingerMs = linger;
    this.#refill = refill;
  }

  // ------------------------------------------------------------------ public

  /**
   * Asks {@link run} to return: running handlers may finish within the grace. Returns at once;
   * await the `run()` promise to know when the worker is done.
   */
  stop(): void {
    this.#stopping.set();
    this.#flushNow.set();
  }

  /** Whether {@link stop} has been called (and the run has not returned yet). */
  get stopping(): boolean {
    return this.#stopping.isSet;
  }

  /** Todos held now: claimed and not yet settled (at most `concurrency`). */
  get held(): number {
    return this.#held.size;
  }

  /**
   * Claims and handles todos until {@link stop} is called (or `signal` aborts).
   *
   * Rejects with the `ConnectError` of a `ClaimNext` that failed with a non-transient code (a
   * bad token, a missing grant), after settling the todos held.
   */
  async run(options: RunOptions = {}): Promise<void> {
    if (this.#running) throw new Error("this worker is already running");
    this.#running = true;
    this.#ending = new Flag();
    this.#endingAbort = new AbortController();
    const onAbort = () => this.stop();
    if (options.signal?.aborted) this.stop();
    options.signal?.addEventListener("abort", onAbort);
    // Neither is expected to throw; if one does, say so rather than crash the process.
    const watch = this.#watch().catch((err: unknown) => {
      this.#log.error(`the doorbell watch died: ${errorText(err)}`);
      this.notifyError(err, { retrying: false });
    });
    const heartbeats = this.#heartbeats().catch((err: unknown) => {
      this.#log.error(`the heartbeats died (leases will lapse): ${errorText(err)}`);
      this.notifyError(err, { retrying: false });
    });
    let settlerError: { error: unknown } | undefined;
    const settlerDied = new Flag();
    const settler = this.#settler().catch((error: unknown) => {
      settlerError = { error };
      settlerDied.set();
    });
    try {
      try {
        await this.#claimLoop(options.maxTodos, options.stopWhenIdle ?? false);
      } catch (err) {
        await this.#windDown("grace", settlerDied, () => settlerError);
        throw err;
      }
      await this.#windDown("finish", settlerDied, () => settlerError);
    } finally {
      options.signal?.removeEventListener("abort", onAbort);
      this.#ending.set();
      this.#endingAbort.abort();
      for (const held of this.#held.values()) held.abort.abort();
      await Promise.allSettled([watch, heartbeats, settler]);
      this.#held.clear();
      this.#ready = [];
      this.watching.clear();
      this.#stopping.clear();
      this.#flushNow.clear();
      this.#running = false;
    }
  }

  // ------------------------------------------------------------------ calls

  async #unary<T>(
    name: WorkerRpc,
    call: (options: { headers: Record<string, string>; timeoutMs: number; signal: AbortSignal }) => Promise<T>,
  ): Promise<T> {
    this.stats.rpcCalls[name] += 1;
    return call({ headers: this.#headers, timeoutMs: this.rpcTimeoutMs, signal: this.#endingAbort.signal });
  }

  // ------------------------------------------------------------------ claiming

  async #claimLoop(maxTodos: number | undefined, stopWhenIdle: boolean): Promise<void> {
    let claimed = 0;
    while (!this.#stopping.isSet) {
      const left = maxTodos === undefined ? MAX_BATCH : maxTodos - claimed;
      if (left <= 0) break;
      const room = await this.#room(left);
      if (!room) break; // stopped while waiting
      // Cleared before claiming: a doorbell that rings from now on is news the claim may
      // not have seen, so it must wake the wait.
      this.#bell.clear();
      const response = await this.#claimNext(room);
      if (response === undefined) break; // stopped while retrying
      let batch: Array<Pick<ClaimedTodo, "todo" | "lease">> = response.claimed;
      if (batch.length === 0 && !response.empty && response.todo) {
        batch = [{ todo: response.todo, lease: response.lease }];
      }
      this.lastDeferred = response.deferred;
      this.notifyDeferred(response.deferred);
      if (batch.length === 0) {
        if (stopWhenIdle) break;
        await this.#idle(response);
        continue;
      }
      this.#earlyWakes = 0;
      this.stats.batches += 1;
      claimed += batch.length;
      for (const item of batch) {
        if (item.todo && item.lease) this.#start(item.todo, item.lease);
      }
      this.notifyClaimed(
        batch.flatMap((item) => (item.todo && item.lease ? [item.todo] : [])),
        response.deferred.length > 0,
      );
      if (response.deferred.length > 0) {
        this.stats.cutShort += 1;
        if (!stopWhenIdle && this.#allDeferred(response.deferred)) await this.#idle(response);
      }
    }
  }

  /** Waits until enough handler slots are free; how many todos to claim (0: stopped). */
  async #room(left: number): Promise<number> {
    const need = Math.min(this.#refill, left);
    while (!this.#stopping.isSet) {
      const room = this.concurrency - this.#held.size;
      if (room >= need) return Math.min(room, this.prefetch, left);
      this.#freed.clear();
      await waitFor(null, this.#freed, this.#stopping);
    }
    return 0;
  }

  #allDeferred(deferred: DeferredQueue[]): boolean {
    const names = new Set(deferred.map((d) => d.queue?.name));
    return this.queues.length > 0 && this.queues.every((q) => names.has(q));
  }

  /** One `ClaimNext` for up to `count` todos, retried on transient errors; undefined when stopped. */
  async #claimNext(count: number): Promise<ClaimNextResponse | undefined> {
    const request = {
      endpointId: this.endpointId,
      queues: [...this.queues],
      claimant: this.claimant,
      leaseDuration: msDuration(this.leaseMs),
      maxTodos: count,
    };
    const backoff = new Backoff(200, 30_000);
    for (;;) {
      let delay: number;
      try {
        const response = await this.#unary("ClaimNext", (o) => this.#client.claimNext(request, o));
        return jsonable(ClaimNextResponseSchema, response);
      } catch (err) {
        const e = ConnectError.from(err);
        const retrying = TRANSIENT_CODES.has(e.code);
        this.notifyError(e, { rpc: "ClaimNext", retrying });
        if (!retrying) throw e;
        delay = backoff.next();
        this.#log.warn(`ClaimNext failed (${describe(e)}); retrying in ${(delay / 1000).toFixed(1)}s`);
      }
      if (await waitFor(delay, this.#stopping)) return undefined;
    }
  }

  // ------------------------------------------------------------------ waiting

  /** Waits after an empty (or cut short) claim: for a doorbell, an exact reopen time, or stop. */
  async #idle(response: ClaimNextResponse): Promise<void> {
    let wait = this.maxIdleWaitMs;
    const exact = response.deferred.filter((d) => d.exact && d.nextEligibleAt);
    if (response.deferred.length > 0) this.stats.deferredWaits += 1;
    else this.stats.idleWaits += 1;
    if (exact.length > 0) {
      const earliest = Math.min(...exact.map((d) => timestampMs(d.nextEligibleAt!)));
      // next_eligible_at is on the server's clock; the local one is close enough.
      let delay = earliest - Date.now();
      if (delay > 0) {
        this.#earlyWakes = 0;
        // A little jitter so a fleet does not claim in lockstep at the boundary.
        delay += Math.random() * Math.min(1000, delay * 0.05);
      } else {
        // Still deferred past the time by our clock: the clocks disagree. Back off
        // (1 s, 2 s, 4 s, ...) and count on the doorbell.
        delay = Math.min(1000 * 2 ** this.#earlyWakes, wait);
        this.#earlyWakes += 1;
      }
      wait = Math.min(wait, delay);
    }
    this.#log.debug(`nothing more claimable; waiting up to ${(wait / 1000).toFixed(1)}s for a doorbell`);
    await waitFor(wait, this.#bell, this.#stopping);
  }

  /** Keeps a `WatchReopen` stream open, reopening it with backoff when it breaks. */
  async #watch(): Promise<void> {
    const request = { endpointId: this.endpointId, queues: [...this.queues] };
    const backoff = new Backoff(200, 30_000);
    while (!this.#ending.isSet) {
      this.stats.rpcCalls.WatchReopen += 1;
      const opened = now();
      try {
        const stream = this.#client.watchReopen(request, {
          headers: this.#headers,
          signal: this.#endingAbort.signal,
          // The server sends headers once the subscription is registered; a refused call
          // ends with trailers-only headers that carry grpc-status.
          onHeader: (headers) => {
            if (!headers.has("grpc-status")) this.watching.set();
          },
        });
        for await (const message of stream) {
          jsonable(WatchReopenResponseSchema, message);
          this.stats.doorbells += 1;
          this.lastDoorbell = message.doorbell;
          this.#bell.set();
          if (message.doorbell) this.notifyDoorbell(message.doorbell);
        }
        this.#log.info("WatchReopen stream ended by the server; reopening");
      } catch (err) {
        if (this.#ending.isSet) break;
        const e = ConnectError.from(err);
        const text = `WatchReopen failed (${describe(e)})`;
        if (TRANSIENT_CODES.has(e.code)) this.#log.warn(text);
        else this.#log.error(text);
        this.notifyError(e, { rpc: "WatchReopen", retrying: true });
      } finally {
        this.watching.clear();
      }
      if (now() - opened >= HEALTHY_STREAM_MS) backoff.reset();
      // A reopened stream rings ATTACHED for work already waiting, so no ring missed while
      // it was down goes unnoticed.
      await waitFor(backoff.next(), this.#ending);
    }
  }

  // ------------------------------------------------------------------ handling

  /** Holds a claimed todo and starts its handler. */
  #start(todo: Todo, lease: Lease): void {
    this.stats.claimed += 1;
    const t = now();
    const previous = this.#held.get(todo.id);
    if (previous !== undefined) {
      // Claimed again under a new lease: ours had lapsed and was taken over.
      this.#stale(previous, "claimed again by this worker under a new lease");
    }
    const held: Held = {
      todoId: todo.id,
      leaseId: lease.leaseId,
      expires: t + this.leaseMs,
      extendedAt: t,
      abort: new AbortController(),
      handled: false,
      finishedAt: 0,
      settling: false,
      lost: false,
    };
    this.#held.set(todo.id, held);
    const signal = held.abort.signal;
    Promise.resolve()
      .then(() => this.#handler(todo, signal))
      .then(
        () => this.#handlerDone(held, { ok: true }),
        (error: unknown) => this.#handlerDone(held, { ok: false, error }),
      );
    this.#added.set();
  }

  /** Aborts a handler: the worker stops waiting for it, and its todo is released (or dropped). */
  #cancel(held: Held): void {
    if (held.handled) return;
    held.abort.abort();
    this.#handlerDone(held, { cancelled: true });
  }

  /** Turns a finished handler into its todo's settlement (or drops a lost todo). */
  #handlerDone(held: Held, outcome: { ok: true } | { ok: false; error: unknown } | { cancelled: true }): void {
    if (held.handled) return; // abandoned earlier: its late outcome no longer matters
    held.handled = true;
    if (held.lost) {
      this.stats.lost += 1;
      this.#log.warn(`todo ${held.todoId} was taken over; its handler was aborted`);
      this.#forget(held);
      this.notifySettled(held.todoId, "lost");
      return;
    }
    const base = { todoId: held.todoId, leaseId: held.leaseId };
    let settlement: Settlement;
    if ("cancelled" in outcome) {
      settlement = create(SettlementSchema, { ...base, action: { case: "release", value: {} } });
    } else if (outcome.ok) {
      settlement = create(SettlementSchema, { ...base, action: { case: "complete", value: {} } });
    } else {
      const permanent = outcome.error instanceof PermanentFailure;
      this.#log.warn(
        `handler failed on todo ${held.todoId}${permanent ? " (permanently)" : ""}: ${errorText(outcome.error)}`,
      );
      settlement = create(SettlementSchema, {
        ...base,
        action: { case: "fail", value: { error: errorText(outcome.error), permanent } },
      });
    }
    held.settlement = settlement;
    held.finishedAt = now();
    this.#ready.push(held);
    this.#finished.set();
  }

  /** Drops a todo that is settled or no longer ours, freeing its slot. */
  #forget(held: Held): void {
    if (this.#held.get(held.todoId) === held) this.#held.delete(held.todoId);
    this.#freed.set();
  }

  /** The server said the lease is no longer ours: stop working on the todo. */
  #stale(held: Held, why: string): void {
    if (held.lost || held.settling || this.#held.get(held.todoId) !== held) return;
    held.lost = true;
    if (held.settlement === undefined) {
      this.#log.warn(`lease on todo ${held.todoId} is stale (${why}); aborting its handler`);
      this.#cancel(held); // counts and forgets it
      return;
    }
    this.#log.warn(`lease on todo ${held.todoId} is stale (${why}); dropping its settlement`);
    this.#ready = this.#ready.filter((h) => h !== held);
    this.stats.lost += 1;
    this.#forget(held);
    this.notifySettled(held.todoId, "lost");
  }

  // ------------------------------------------------------------------ leases

  /** Extends every lease held (not yet being settled) together, when the oldest is due. */
  async #heartbeats(): Promise<void> {
    const every = this.heartbeatEveryMs;
    let retryAt = 0;
    while (!this.#ending.isSet) {
      const beating = [...this.#held.values()].filter((h) => !h.settling && !h.lost);
      if (beating.length === 0) {
        this.#added.clear();
        await waitFor(null, this.#added, this.#ending);
        continue;
      }
      const due = Math.max(Math.min(...beating.map((h) => h.extendedAt)) + every, retryAt);
      const delay = due - now();
      if (delay > 0) {
        await waitFor(delay, this.#ending);
        continue;
      }
      if (await this.#beat(beating)) retryAt = 0;
      else retryAt = now() + Math.min(every, 1000); // try again sooner; they may still be ours
    }
  }

  /** One heartbeat call for `beating`; whether the server answered for each. */
  async #beat(beating: Held[]): Promise<boolean> {
    const sent = now();
    const leaseDuration = msDuration(this.leaseMs);
    if (beating.length === 1) {
      const held = beating[0]!;
      try {
        await this.#unary("Heartbeat", (o) =>
          this.#client.heartbeat({ todoId: held.todoId, leaseId: held.leaseId, leaseDuration }, o),
        );
      } catch (err) {
        if (this.#ending.isSet) return true;
        const e = ConnectError.from(err);
        if (LEASE_LOST_CODES.has(e.code)) {
          this.#stale(held, e.rawMessage || Code[e.code]);
          return true;
        }
        this.#log.warn(`heartbeat failed (${describe(e)})`);
        this.notifyError(e, { rpc: "Heartbeat", retrying: true, todoIds: [held.todoId] });
        return false;
      }
      this.#extended(held, sent);
      return true;
    }
    let results: Map<string, { status: BatchItemStatus; message: string }>;
    try {
      const response = await this.#unary("HeartbeatTodos", (o) =>
        this.#client.heartbeatTodos(
          { leases: beating.map((h) => ({ todoId: h.todoId, leaseId: h.leaseId })), leaseDuration },
          o,
        ),
      );
      results = new Map(response.results.map((r) => [r.todoId, r]));
    } catch (err) {
      if (this.#ending.isSet) return true;
      this.#log.warn(`heartbeat of ${beating.length} leases failed (${describe(err)})`);
      this.notifyError(ConnectError.from(err), {
        rpc: "HeartbeatTodos",
        retrying: true,
        todoIds: beating.map((h) => h.todoId),
      });
      return false;
    }
    let answered = true;
    for (const held of beating) {
      const result = results.get(held.todoId);
      if (result?.status === BatchItemStatus.APPLIED) this.#extended(held, sent);
      else if (result !== undefined && REFUSED.has(result.status)) {
        this.#stale(held, result.message || BatchItemStatus[result.status]);
      } else answered = false; // left out, or a status this client does not know
    }
    return answered;
  }

  #extended(held: Held, sent: number): void {
    held.extendedAt = sent;
    held.expires = sent + this.leaseMs;
  }

  // ------------------------------------------------------------------ settling

  /** Sends the settlements of finished handlers, in batches. */
  async #settler(): Promise<void> {
    const linger = this.settleLingerMs;
    while (!this.#ending.isSet) {
      if (this.#ready.length === 0) {
        this.#finished.clear();
        await waitFor(null, this.#finished, this.#ending);
        continue;
      }
      const wait = this.#flushWait(linger);
      if (wait > 0) {
        this.#finished.clear();
        await waitFor(wait, this.#finished, this.#flushNow, this.#ending);
        continue;
      }
      const batch = this.#ready.splice(0, MAX_BATCH);
      for (const held of batch) held.settling = true;
      if (this.concurrency === 1) {
        for (const held of batch) await this.#settleOne(held);
      } else {
        await this.#settleMany(batch);
      }
    }
  }

  /** Milliseconds until the waiting settlements are due (0 or less: now). */
  #flushWait(linger: number): number {
    if (
      this.#ready.length >= this.settleBatch ||
      this.#flushNow.isSet ||
      [...this.#held.values()].every((h) => h.settlement !== undefined)
    ) {
      return 0;
    }
    return this.#ready[0]!.finishedAt + linger - now();
  }

  #count(settlement: Settlement): void {
    const action = settlement.action;
    if (action.case === "complete") {
      this.stats.completed += 1;
      this.notifySettled(settlement.todoId, "completed");
    } else if (action.case === "fail") {
      this.stats.failed += 1;
      if (action.value.permanent) this.stats.deadLettered += 1;
      this.notifySettled(settlement.todoId, "failed", action.value);
    } else {
      this.stats.released += 1;
      this.notifySettled(settlement.todoId, "released");
    }
  }

  /** Settles one todo with `Complete`, `Fail` or `Release`. */
  async #settleOne(held: Held): Promise<void> {
    const s = held.settlement!;
    const ref = { todoId: s.todoId, leaseId: s.leaseId };
    let ok: boolean;
    if (s.action.case === "complete") {
      ok = await this.#settle(held, "Complete", (o) => this.#client.complete(ref, o));
    } else if (s.action.case === "fail") {
      const { error, permanent } = s.action.value;
      ok = await this.#settle(held, "Fail", (o) => this.#client.fail({ ...ref, error, permanent }, o));
    } else {
      ok = await this.#settle(held, "Release", (o) => this.#client.release(ref, o));
    }
    if (ok) this.#count(s);
    this.#forget(held);
  }

  /** Completes, fails or releases, retrying transient errors while the lease lasts. */
  async #settle(
    held: Held,
    name: "Complete" | "Fail" | "Release",
    call: (options: { headers: Record<string, string>; timeoutMs: number; signal: AbortSignal }) => Promise<unknown>,
  ): Promise<boolean> {
    const backoff = new Backoff(100, 5000);
    for (;;) {
      let delay: number;
      try {
        await this.#unary(name, call);
        return true;
      } catch (err) {
        const e = ConnectError.from(err);
        if (LEASE_LOST_CODES.has(e.code)) {
          this.#settlementRefused(held, name, e.rawMessage);
          return false;
        }
        const remaining = held.expires - now();
        if (!TRANSIENT_CODES.has(e.code) || remaining <= 0 || this.#ending.isSet) {
          this.stats.unsettled += 1;
          this.#log.error(`${name} of todo ${held.todoId} failed (${describe(e)}); the lease will lapse`);
          this.notifyError(e, { rpc: name, retrying: false, todoIds: [held.todoId] });
          this.notifySettled(held.todoId, "unsettled");
          return false;
        }
        this.notifyError(e, { rpc: name, retrying: true, todoIds: [held.todoId] });
        delay = Math.min(backoff.next(), remaining);
        this.#log.warn(`${name} failed (${Code[e.code]}); retrying in ${(delay / 1000).toFixed(1)}s`);
      }
      await waitFor(delay, this.#ending);
    }
  }

  /** Settles `batch` with `SettleTodos`, retrying transient errors while the leases last. */
  async #settleMany(batch: Held[]): Promise<void> {
    const backoff = new Backoff(100, 5000);
    let retried = false;
    let results: Map<string, SettlementResult>;
    for (;;) {
      let delay: number;
      try {
        const settlements = batch.map((h) => h.settlement!);
        const response = await this.#unary("SettleTodos", (o) => this.#client.settleTodos({ settlements }, o));
        results = new Map(response.results.map((r) => [r.todoId, r]));
        break;
      } catch (err) {
        const e = ConnectError.from(err);
        const t = now();
        const transient = TRANSIENT_CODES.has(e.code) && !this.#ending.isSet;
        const todoIds = batch.map((h) => h.todoId);
        for (const held of batch.filter((h) => !transient || h.expires <= t)) {
          this.stats.unsettled += 1;
          this.#log.error(`settling todo ${held.todoId} failed (${describe(e)}); the lease will lapse`);
          batch = batch.filter((h) => h !== held);
          this.#forget(held);
          this.notifySettled(held.todoId, "unsettled");
        }
        this.notifyError(e, { rpc: "SettleTodos", retrying: batch.length > 0, todoIds });
        if (batch.length === 0) return;
        delay = Math.min(backoff.next(), Math.max(...batch.map((h) => h.expires)) - t);
        this.#log.warn(
          `SettleTodos of ${batch.length} todos failed (${Code[e.code]}); retrying in ${(delay / 1000).toFixed(1)}s`,
        );
        // The failed call may have been applied: its items then come back refused.
        retried = true;
      }
      await waitFor(delay, this.#ending);
    }
    for (const held of batch) {
      this.#settled(held, results.get(held.todoId), retried);
      this.#forget(held);
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
    if (
      retried &&
      result?.status === BatchItemStatus.NOT_CLAIMED &&
      SETTLED_STATES[action]?.has(result.state)
    ) {
      this.#log.info(`todo ${held.todoId} was settled by an earlier try of the same call`);
      this.#count(s);
      return;
    }
    this.#settlementRefused(held, action, result ? result.message : "missing from the answer");
  }

  /** A settlement refused for a stale lease: the todo is lost, never retried. */
  #settlementRefused(held: Held, action: string, why: string): void {
    held.lost = true;
    this.stats.lost += 1;
    this.#log.warn(`${action} of todo ${held.todoId} refused: the lease is stale (${why})`);
    this.notifySettled(held.todoId, "lost");
  }

  // ------------------------------------------------------------------ shutdown

  #runningHandlers(): Held[] {
    return [...this.#held.values()].filter((h) => !h.handled);
  }

  /** Waits until no handler runs, `ms` pass, or one of `flags` is set. */
  async #waitHandlers(ms: number | null, ...flags: Flag[]): Promise<void> {
    const deadline = ms === null ? null : now() + ms;
    while (this.#runningHandlers().length > 0) {
      if (flags.some((f) => f.isSet)) return;
      const left = deadline === null ? null : deadline - now();
      if (left !== null && left <= 0) return;
      this.#finished.clear();
      this.#freed.clear();
      await waitFor(left, this.#finished, this.#freed, ...flags);
    }
  }

  /**
   * Ends the handlers and waits until every todo held is settled: `finish` waits for the
   * handlers (for at most the grace once stopped), `grace` gives them the grace; handlers
   * still running then are aborted and their todos released.
   */
  async #windDown(how: "finish" | "grace", settlerDied: Flag, settlerError: () => { error: unknown } | undefined): Promise<void> {
    if (how === "finish" && this.#runningHandlers().length > 0) {
      await this.#waitHandlers(null, this.#stopping);
    }
    let running = this.#runningHandlers();
    if (running.length > 0) {
      this.#log.info(
        `stopping: letting ${running.length} running handler(s) finish (up to ${(this.shutdownGraceMs / 1000).toFixed(1)}s)`,
      );
      await this.#waitHandlers(this.shutdownGraceMs);
      running = this.#runningHandlers();
      if (running.length > 0) {
        this.#log.warn(
          `shutdown grace ran out; aborting ${running.length} handler(s) and releasing their todos`,
        );
      }
    }
    for (const held of running) this.#cancel(held);
    this.#flushNow.set();
    while (this.#held.size > 0) {
      this.#freed.clear();
      await waitFor(null, this.#freed, settlerDied);
      const died = settlerError();
      if (died !== undefined) throw died.error;
    }
  }
}

/** A protobuf `Duration` init of `ms` milliseconds. */
function msDuration(ms: number): { seconds: bigint; nanos: number } {
  const seconds = Math.floor(ms / 1000);
  return { seconds: BigInt(seconds), nanos: Math.round((ms - seconds * 1000) * 1e6) };
}
