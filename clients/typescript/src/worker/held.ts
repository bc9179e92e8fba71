/**
 * The held todos: what the worker holds, and its free handler slots.
 *
 * {@link HeldTodos} keeps each claimed todo (a {@link Held}) from its claim until it is settled
 * or its lease is lost, and wakes the other parts when one joins (`added`: the lease keeper) or
 * leaves (`freed`: the claimer waiting for room, the wind-down waiting for the last one). It
 * makes no call.
 */
import type { Settlement } from "../gen/switchboard/v1/dispatch_pb.js";
import { Flag, waitFor } from "./flags.js";
import { now } from "./common.js";

/** A claimed todo, from its claim until it is settled (or its lease is lost). */
export interface Held {
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
  /** How to settle it, once the handler has finished. */
  settlement?: Settlement;
  /** Local monotonic time the handler finished. */
  finishedAt: number;
  /** Set once its settlement is being sent: heartbeats leave it alone from then on. */
  settling: boolean;
  /** Set when the server said the lease is stale. */
  lost: boolean;
  /** With `lost`: the lease is void because the todo was cancelled. */
  cancelled: boolean;
}

/**
 * The todos held, by id, and the handler slots they take (`slots` in all). A todo takes its slot
 * from its claim until it is settled or lost, so the worker never claims a todo it has no
 * handler slot for.
 */
export class HeldTodos {
  readonly #byId = new Map<string, Held>();
  /** Set when a todo joins. */
  readonly added = new Flag();
  /** Set when a todo leaves (and when a handler finishes: see {@link finished}). */
  readonly freed = new Flag();
  /** Set when a handler's outcome is known. */
  readonly finished = new Flag();

  constructor(
    readonly slots: number,
    private readonly leaseMs: number,
  ) {}

  get size(): number {
    return this.#byId.size;
  }

  /** Handler slots free now. */
  get free(): number {
    return this.slots - this.#byId.size;
  }

  /**
   * Holds a todo just claimed; with the todo it replaces, if this worker held it already (under
   * a lease that lapsed and was taken over by this claim).
   */
  take(todoId: string, leaseId: string): { held: Held; previous: Held | undefined } {
    const t = now();
    const previous = this.#byId.get(todoId);
    const held: Held = {
      todoId,
      leaseId,
      expires: t + this.leaseMs,
      extendedAt: t,
      abort: new AbortController(),
      handled: false,
      finishedAt: 0,
      settling: false,
      lost: false,
      cancelled: false,
    };
    this.#byId.set(todoId, held);
    this.added.set();
    return { held, previous };
  }

  /** Whether `held` is still held (not settled, lost or replaced). */
  holds(held: Held): boolean {
    return this.#byId.get(held.todoId) === held;
  }

  /** Drops a todo that is settled or no longer ours, freeing its slot. */
  forget(held: Held): void {
    if (this.holds(held)) this.#byId.delete(held.todoId);
    this.freed.set();
  }

  /** The server extended the lease by a call sent at `sent`. */
  extended(held: Held, sent: number): void {
    held.extendedAt = sent;
    held.expires = sent + this.leaseMs;
  }

  /** The todos whose leases need heartbeats: not being settled, not lost. */
  beating(): Held[] {
    return [...this.#byId.values()].filter((h) => !h.settling && !h.lost);
  }

  /** The todos whose handlers still run. */
  running(): Held[] {
    return [...this.#byId.values()].filter((h) => !h.handled);
  }

  /** Every todo held. */
  all(): Held[] {
    return [...this.#byId.values()];
  }

  /** Whether every todo held has its outcome (no handler is running). */
  allFinished(): boolean {
    return [...this.#byId.values()].every((h) => h.settlement !== undefined);
  }

  /** Waits until at least `need` slots are free; how many are (0: stopped). */
  async room(need: number, stopping: Flag): Promise<number> {
    while (!stopping.isSet) {
      if (this.free >= need) return this.free;
      this.freed.clear();
      await waitFor(null, this.freed, stopping);
    }
    return 0;
  }

  /** Waits until no handler runs, `ms` pass, or one of `flags` is set. */
  async handlersDone(ms: number | null, ...flags: Flag[]): Promise<void> {
    const deadline = ms === null ? null : now() + ms;
    while (this.running().length > 0) {
      if (flags.some((f) => f.isSet)) return;
      const left = deadline === null ? null : deadline - now();
      if (left !== null && left <= 0) return;
      this.finished.clear();
      this.freed.clear();
      await waitFor(left, this.finished, this.freed, ...flags);
    }
  }

  /** Forgets everything (the end of a run). */
  clear(): void {
    this.#byId.clear();
  }
}
