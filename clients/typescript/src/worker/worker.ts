/**
 * {@link Worker}: claims todos and runs a handler on each, heartbeats their leases, settles
 * their outcomes in batches, and waits at the server (a held `ClaimNext`) when idle. The same
 * semantics as the Python `switchboard_dispatch.worker.Worker` (see the package README for the
 * two side by side), and the same parts, one file each:
 *
 * - {@link HeldTodos} (`held.ts`): what the worker holds: each claimed todo from its claim until
 *   it is settled or lost, and the free handler slots;
 * - {@link Handlers} (`handlers.ts`): runs the handler of each todo held and turns its end into
 *   the todo's settlement; aborts a handler whose lease is lost;
 * - {@link Settler} (`settler.ts`): sends settlements, batched in `SettleTodos` (or one by one
 *   with `Complete`, `Fail`, `Release`), retried while leases last;
 * - {@link LeaseKeeper} (`lease-keeper.ts`): heartbeats every lease held in one call
 *   (`Heartbeat`, `HeartbeatTodos`) and reports leases lost;
 * - {@link Claimer} (`claimer.ts`): `ClaimNext` with a `wait` into free slots, a thin loop over
 *   the server's held claim;
 * - {@link Worker} (here): builds the parts from the options, runs them, stops them (the
 *   shutdown grace, then every todo held settled).
 *
 * Beside them: `rpc.ts` (the client, the credential, the deadlines, `stats.rpcCalls`),
 * `common.ts` (the public types, limits, retry codes), `stats.ts`, `events.ts` and `flags.ts`.
 */
import type { Transport } from "@connectrpc/connect";

import type { DeferredQueue } from "../gen/switchboard/v1/admission_pb.js";
import type { Doorbell } from "../gen/switchboard/v1/dispatch_pb.js";
import { Claimer } from "./claimer.js";
import {
  MAX_BATCH,
  MAX_WAIT_MS,
  defaultLogger,
  errorText,
  type Handler,
  type Notify,
  type WorkerLogger,
} from "./common.js";
import { WorkerEvents } from "./events.js";
import { Flag, waitFor } from "./flags.js";
import { Handlers } from "./handlers.js";
import { HeldTodos } from "./held.js";
import { LeaseKeeper } from "./lease-keeper.js";
import { Rpc } from "./rpc.js";
import { Settler } from "./settler.js";
import { WorkerStats } from "./stats.js";

export { MAX_BATCH, PermanentFailure, TRANSIENT_CODES, type Handler, type WorkerLogger } from "./common.js";

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
  /**
   * How long each `ClaimNext` may be held at the server while nothing is claimable (at most
   * 60 s, the server's limit: a longer value means 60 s): an idle worker claims once per this.
   * Default 5 minutes (so 60 s). It used to bound the wait for a `WatchReopen` doorbell; the
   * worker no longer opens one.
   */
  maxIdleWaitMs?: number | undefined;
  /** How long a stop lets running handlers finish; default 30 s. */
  shutdownGraceMs?: number | undefined;
  /** The deadline of each unary RPC (a held `ClaimNext`'s is its wait plus this); default 30 s. */
  rpcTimeoutMs?: number | undefined;
  /** The most todos one `ClaimNext` claims (1 to 500; default 1). */
  prefetch?: number | undefined;
  /** The most handlers at once, also the most todos held (prefetch to 500; default prefetch). */
  concurrency?: number | undefined;
  /**
   * Send a `SettleTodos` once this many outcomes wait; default the refill size. A call carries at
   * most 1 MiB of encoded settlements (within the server's request limit, `MAX_SEND_BYTES`): a
   * larger batch goes as several calls.
   */
  settleBatch?: number | undefined;
  /** The longest an outcome waits for others to join its `SettleTodos`; default 50 ms. */
  settleLingerMs?: number | undefined;
  log?: WorkerLogger | undefined;
}

/** How {@link Worker.run} ends. */
export interface RunOptions {
  /** Return after this many todos were claimed and settled. */
  maxTodos?: number | undefined;
  /**
   * Return the first time `ClaimNext` finds nothing claimable (claiming without a wait), once
   * the todos held are settled.
   */
  stopWhenIdle?: boolean | undefined;
  /** Aborting it stops the worker as {@link Worker.stop} does. */
  signal?: AbortSignal | undefined;
}

/**
 * Claims todos and runs `handler` on each; see the package README for the whole behaviour:
 * batches (`prefetch`, `concurrency`), heartbeats, settlement batches, held claims and
 * deferrals, failures and shutdown. Emits `claimed`, `settled`, `deferred` and `error`
 * ({@link WorkerEvents}; `doorbell` no longer fires: the worker opens no `WatchReopen` stream).
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
  /**
   * Always undefined: the worker opens no `WatchReopen` stream any more (its held claims are
   * woken by the same events); kept so old code still compiles.
   */
  lastDoorbell: Doorbell | undefined = undefined;

  readonly #log: WorkerLogger;
  readonly #rpc: Rpc;
  readonly #held: HeldTodos;
  readonly #settler: Settler;
  readonly #handlers: Handlers;
  readonly #leaseKeeper: LeaseKeeper;
  readonly #claimer: Claimer;

  #running = false;
  readonly #stopping = new Flag();
  /** Set when the run is over: the lease keeper and the settler return. */
  #ending = new Flag();

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

    const notify: Notify = {
      claimed: (todos, cutShort) => this.notifyClaimed(todos, cutShort),
      settled: (todoId, outcome, failure) => this.notifySettled(todoId, outcome, failure),
      deferred: (deferred) => this.notifyDeferred(deferred),
      error: (error, info) => this.notifyError(error, info),
    };
    const log = this.#log;
    this.#rpc = new Rpc(options.transport, options.token, timeout, this.stats);
    this.#held = new HeldTodos(slots, lease);
    this.#settler = new Settler(this.#rpc, this.#held, this.stats, log, notify, {
      oneByOne: slots === 1,
      batch: flushAt,
      lingerMs: linger,
    });
    this.#handlers = new Handlers(options.handler, this.#held, this.#settler, this.stats, log, notify);
    this.#leaseKeeper = new LeaseKeeper(
      this.#rpc,
      this.#held,
      lease,
      beat,
      (held, why, cancelled) => this.#handlers.leaseLost(held, why, cancelled),
      log,
      notify,
    );
    const claim = {
      endpointId: this.endpointId,
      queues: this.queues,
      claimant: this.claimant,
      leaseMs: lease,
      prefetch,
      refill,
      waitMs: Math.min(idle, MAX_WAIT_MS),
    };
    this.#claimer = new Claimer(this.#rpc, this.#held, this.stats, (t, l) => this.#handlers.start(t, l), claim, log, notify);
  }

  // ------------------------------------------------------------------ public

  /**
   * Asks {@link run} to return: running handlers may finish within the grace, a held
   * `ClaimNext` is cancelled at once. Returns at once; await the `run()` promise to know when
   * the worker is done. Calling it before `run()` makes the next run return without claiming.
   */
  stop(): void {
    this.#stopping.set();
    this.#settler.flush();
    this.#claimer.interrupt();
  }

  /** Whether {@link stop} has been called (and the run has not returned yet). */
  get stopping(): boolean {
    return this.#stopping.isSet;
  }

  /** Todos held now: claimed and not yet settled (at most `concurrency`). */
  get held(): number {
    return this.#held.size;
  }

  /** The deferred queues of the last `ClaimNext` (empty answer: all; cut-short batch: its queue). */
  get lastDeferred(): DeferredQueue[] {
    return this.#claimer.lastDeferred;
  }

  /**
   * Set while a held `ClaimNext` is out: the worker waits at the server for work (the name is
   * from when it watched a `WatchReopen` stream instead).
   */
  get watching(): Flag {
    return this.#claimer.waiting;
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
    this.#rpc.begin();
    const ending = this.#ending;
    const onAbort = () => this.stop();
    if (options.signal?.aborted) this.stop();
    options.signal?.addEventListener("abort", onAbort);
    // Not expected to throw; if it does, say so rather than crash the process.
    const leaseKeeper = this.#leaseKeeper.run(ending).catch((err: unknown) => {
      this.#log.error(`the heartbeats died (leases will lapse): ${errorText(err)}`);
      this.notifyError(err, { retrying: false });
    });
    let settlerError: { error: unknown } | undefined;
    const settlerDied = new Flag();
    const settler = this.#settler.run(ending).catch((error: unknown) => {
      settlerError = { error };
      settlerDied.set();
    });
    try {
      try {
        await this.#claimer.run(this.#stopping, options.maxTodos, options.stopWhenIdle ?? false);
      } catch (err) {
        await this.#windDown("grace", settlerDied, () => settlerError);
        throw err;
      }
      await this.#windDown("finish", settlerDied, () => settlerError);
    } finally {
      options.signal?.removeEventListener("abort", onAbort);
      ending.set();
      this.#rpc.end();
      for (const held of this.#held.all()) held.abort.abort();
      await Promise.allSettled([leaseKeeper, settler]);
      this.#held.clear();
      this.#settler.reset();
      this.#stopping.clear();
      this.#running = false;
    }
  }

  // ------------------------------------------------------------------ shutdown

  /**
   * Ends the handlers and waits until every todo held is settled: `finish` waits for the
   * handlers (for at most the grace once stopped), `grace` gives them the grace; handlers
   * still running then are aborted and their todos released.
   */
  async #windDown(
    how: "finish" | "grace",
    settlerDied: Flag,
    settlerError: () => { error: unknown } | undefined,
  ): Promise<void> {
    const held = this.#held;
    if (how === "finish" && held.running().length > 0) await held.handlersDone(null, this.#stopping);
    let running = held.running();
    if (running.length > 0) {
      this.#log.info(
        `stopping: letting ${running.length} running handler(s) finish (up to ${(this.shutdownGraceMs / 1000).toFixed(1)}s)`,
      );
      await held.handlersDone(this.shutdownGraceMs);
      running = held.running();
      if (running.length > 0) {
        this.#log.warn(`shutdown grace ran out; aborting ${running.length} handler(s) and releasing their todos`);
      }
    }
    for (const h of running) this.#handlers.cancel(h);
    this.#settler.flush();
    while (held.size > 0) {
      held.freed.clear();
      await waitFor(null, held.freed, settlerDied);
      const died = settlerError();
      if (died !== undefined) throw died.error;
    }
  }
}
