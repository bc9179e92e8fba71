/**
 * The handlers: each claimed todo's handler, and the outcome it ends in.
 *
 * {@link Handlers.start} holds a claimed todo and starts its handler; when the handler ends, its
 * outcome becomes the todo's settlement (complete; fail, permanently for
 * {@link PermanentFailure}; release when it was aborted) and goes to the settler.
 * {@link Handlers.leaseLost} stops working on a todo whose lease the server says is no longer
 * ours (taken over, reaped, or cancelled by an operator): its handler is aborted, or its
 * settlement withdrawn, and nothing is sent.
 */
import { create } from "@bufbuild/protobuf";

import { SettlementSchema, type Settlement } from "../gen/switchboard/v1/dispatch_pb.js";
import type { Lease, Todo } from "../gen/switchboard/v1/todo_pb.js";
import { PermanentFailure, errorText, now, type Handler, type Notify, type WorkerLogger } from "./common.js";
import type { Held, HeldTodos } from "./held.js";
import type { Settler } from "./settler.js";
import type { WorkerStats } from "./stats.js";

/** How a handler ended. */
type Outcome = { ok: true } | { ok: false; error: unknown } | { cancelled: true };

/** Runs the handler on each todo held (see the module docs). */
export class Handlers {
  constructor(
    private readonly handler: Handler,
    private readonly held: HeldTodos,
    private readonly settler: Settler,
    private readonly stats: WorkerStats,
    private readonly log: WorkerLogger,
    private readonly notify: Notify,
  ) {}

  /** Holds a claimed todo and starts its handler. */
  start(todo: Todo, lease: Lease): void {
    this.stats.claimed += 1;
    const { held, previous } = this.held.take(todo.id, lease.leaseId);
    if (previous !== undefined && !previous.lost && !previous.settling) {
      // Claimed again under a new lease: ours had lapsed and was taken over.
      this.#lost(previous, "claimed again by this worker under a new lease");
    }
    const signal = held.abort.signal;
    Promise.resolve()
      .then(() => this.handler(todo, signal))
      .then(
        () => this.#done(held, { ok: true }),
        (error: unknown) => this.#done(held, { ok: false, error }),
      );
  }

  /** Aborts a handler: the worker stops waiting for it, and its todo is released (or dropped). */
  cancel(held: Held): void {
    if (held.handled) return;
    held.abort.abort();
    this.#done(held, { cancelled: true });
  }

  /**
   * The server said the lease is no longer ours (`cancelled`: because the todo was cancelled):
   * stop working on the todo.
   */
  leaseLost(held: Held, why: string, cancelled: boolean): void {
    if (held.lost || held.settling || !this.held.holds(held)) return; // gone, or its answer will tell
    held.cancelled = cancelled;
    this.#lost(held, why);
  }

  #lost(held: Held, why: string): void {
    held.lost = true;
    if (held.settlement === undefined) {
      this.log.warn(`lease on todo ${held.todoId} is stale (${why}); aborting its handler`);
      this.cancel(held); // counts and forgets it
      return;
    }
    this.log.warn(`lease on todo ${held.todoId} is stale (${why}); dropping its settlement`);
    this.settler.withdraw(held);
    this.#countLost(held, "its settlement was dropped");
    this.held.forget(held);
  }

  /** Counts (and tells) a todo no longer ours: `cancelled` when an operator cancelled it. */
  #countLost(held: Held, what: string): void {
    if (held.cancelled) {
      this.stats.cancelled += 1;
      this.log.info(`todo ${held.todoId} was cancelled; ${what}`);
      this.notify.settled(held.todoId, "cancelled");
    } else {
      this.stats.lost += 1;
      this.log.warn(`todo ${held.todoId} was taken over; ${what}`);
      this.notify.settled(held.todoId, "lost");
    }
  }

  /** Turns a finished handler into its todo's settlement (or drops a lost todo). */
  #done(held: Held, outcome: Outcome): void {
    if (held.handled) return; // abandoned earlier: its late outcome no longer matters
    held.handled = true;
    this.held.finished.set();
    if (held.lost) {
      this.#countLost(held, "its handler was aborted");
      this.held.forget(held);
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
      this.log.warn(
        `handler failed on todo ${held.todoId}${permanent ? " (permanently)" : ""}: ${errorText(outcome.error)}`,
      );
      settlement = create(SettlementSchema, {
        ...base,
        action: { case: "fail", value: { error: errorText(outcome.error), permanent } },
      });
    }
    held.settlement = settlement;
    held.finishedAt = now();
    this.settler.submit(held);
  }
}
