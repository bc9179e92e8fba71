/**
 * The claimer: `ClaimNext` into free handler slots, held at the server when idle.
 *
 * {@link Claimer} is a thin loop over the waiting claim: it waits for room (at least the refill
 * size of free handler slots: half of `concurrency`, or `prefetch` when that is less), then asks
 * for up to `prefetch` todos with `ClaimNextRequest.wait` (`maxIdleWaitMs`, at most 60 s). With
 * work there the server answers at once; with none, it holds the call and claims as soon as
 * something becomes claimable (a todo created, retried or come due, a window reopening, a slot
 * freeing, a policy raised, a queue resumed), so the worker needs no doorbell stream, no sleep
 * until `nextEligibleAt` and no clock of its own: one `ClaimNext` per `maxIdleWaitMs` while
 * idle. A deferral is never a failure; a batch its queue's budget cut short is followed by a
 * claim that the server holds until the queue admits more.
 *
 * Stop aborts the call in flight at once (the server releases a claim it made for a call that
 * went away); an answer that arrived first is kept, and its todos are handled within the
 * shutdown grace like any other. An empty answer that comes back well before its wait (a server
 * stopping, or one older than held claims, which ignores `wait`) is followed by a growing
 * pause, so the worker never spins. Transient errors are retried with backoff; any other error
 * ends the run.
 */
import { ConnectError } from "@connectrpc/connect";

import type { DeferredQueue } from "../gen/switchboard/v1/admission_pb.js";
import { ClaimNextResponseSchema, type ClaimNextResponse, type ClaimedTodo } from "../gen/switchboard/v1/dispatch_pb.js";
import type { Lease, Todo } from "../gen/switchboard/v1/todo_pb.js";
import { jsonable } from "../json.js";
import { MAX_BATCH, TRANSIENT_CODES, describe, msDuration, now, type Notify, type WorkerLogger } from "./common.js";
import { Backoff, Flag, waitFor } from "./flags.js";
import type { HeldTodos } from "./held.js";
import type { Rpc } from "./rpc.js";
import type { WorkerStats } from "./stats.js";

/** What the claimer asks for. */
export interface ClaimOptions {
  endpointId: string;
  queues: readonly string[];
  claimant: string;
  leaseMs: number;
  prefetch: number;
  /** Claim again once this many handler slots are free, so batches stay batches. */
  refill: number;
  /** How long each idle `ClaimNext` is held at the server (at most 60 s). */
  waitMs: number;
}

/** Given each todo claimed, with its lease (the handlers start it). */
export type Start = (todo: Todo, lease: Lease) => void;

/** Claims todos for the free handler slots (see the module docs). */
export class Claimer {
  /** The deferred queues of the last `ClaimNext` answer: with an empty answer every deferred
   * queue; with a batch its budget cut short, that queue; else none. */
  lastDeferred: DeferredQueue[] = [];
  /** Set while a `ClaimNext` with a wait is out: the worker waits at the server. */
  readonly waiting = new Flag();
  #call: AbortController | undefined;

  constructor(
    private readonly rpc: Rpc,
    private readonly held: HeldTodos,
    private readonly stats: WorkerStats,
    private readonly start: Start,
    private readonly options: ClaimOptions,
    private readonly log: WorkerLogger,
    private readonly notify: Notify,
  ) {}

  /**
   * Claims while there is room, starting a handler per todo, until `stopping` is set, `maxTodos`
   * were claimed, or (`stopWhenIdle`) nothing is claimable.
   */
  async run(stopping: Flag, maxTodos: number | undefined, stopWhenIdle: boolean): Promise<void> {
    const o = this.options;
    const waitMs = stopWhenIdle ? 0 : o.waitMs;
    const early = new Backoff(500, Math.max(o.waitMs, 500));
    let claimed = 0;
    while (!stopping.isSet) {
      const left = maxTodos === undefined ? MAX_BATCH : maxTodos - claimed;
      if (left <= 0) break;
      const room = await this.held.room(Math.min(o.refill, left), stopping);
      if (!room) break; // stopped while waiting
      const sent = now();
      const response = await this.#claim(Math.min(room, o.prefetch, left), waitMs, stopping);
      if (response === undefined) break; // stopped
      let batch: Array<Pick<ClaimedTodo, "todo" | "lease">> = response.claimed;
      if (batch.length === 0 && !response.empty && response.todo) {
        // A single-todo answer (maxTodos 1, or a server without batches).
        batch = [{ todo: response.todo, lease: response.lease }];
      }
      this.lastDeferred = response.deferred;
      this.notify.deferred(response.deferred);
      if (batch.length === 0) {
        if (response.deferred.length > 0) this.stats.deferredWaits += 1;
        else this.stats.idleWaits += 1;
        if (stopWhenIdle) break;
        if (now() - sent < waitMs / 2) {
          // Answered without holding the call: do not spin.
          const pause = early.next();
          this.log.info(`ClaimNext was not held; claiming again in ${(pause / 1000).toFixed(1)}s`);
          if (await waitFor(pause, stopping)) break;
        } else {
          early.reset();
        }
        continue;
      }
      early.reset();
      this.stats.batches += 1;
      claimed += batch.length;
      const todos: Todo[] = [];
      for (const item of batch) {
        if (item.todo && item.lease) {
          this.start(item.todo, item.lease);
          todos.push(item.todo);
        }
      }
      this.notify.claimed(todos, response.deferred.length > 0);
      if (response.deferred.length > 0) this.stats.cutShort += 1;
    }
  }

  /** Aborts the `ClaimNext` in flight, if any (on stop): a held call would otherwise keep the
   * worker up to `maxIdleWaitMs`. */
  interrupt(): void {
    this.#call?.abort();
  }

  /**
   * One `ClaimNext` for up to `count` todos, held up to `waitMs`, retried on transient errors;
   * undefined when stopped first.
   */
  async #claim(count: number, waitMs: number, stopping: Flag): Promise<ClaimNextResponse | undefined> {
    const o = this.options;
    const request = {
      endpointId: o.endpointId,
      queues: [...o.queues],
      claimant: o.claimant,
      leaseDuration: msDuration(o.leaseMs),
      maxTodos: count,
      ...(waitMs > 0 && { wait: msDuration(waitMs) }),
    };
    const backoff = new Backoff(200, 30_000);
    for (;;) {
      if (stopping.isSet) return undefined;
      let delay: number;
      const call = new AbortController();
      this.#call = call;
      if (waitMs > 0) this.waiting.set();
      try {
        const response = await this.rpc.claimNext(request, waitMs, call.signal);
        return jsonable(ClaimNextResponseSchema, response);
      } catch (err) {
        if (call.signal.aborted && stopping.isSet) return undefined; // the stop's
        const e = ConnectError.from(err);
        const retrying = TRANSIENT_CODES.has(e.code);
        this.notify.error(e, { rpc: "ClaimNext", retrying });
        if (!retrying) throw e;
        delay = backoff.next();
        this.log.warn(`ClaimNext failed (${describe(e)}); retrying in ${(delay / 1000).toFixed(1)}s`);
      } finally {
        this.#call = undefined;
        this.waiting.clear();
      }
      if (await waitFor(delay, stopping)) return undefined;
    }
  }
}
