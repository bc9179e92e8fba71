/**
 * The worker's events: {@link WorkerEvents}, the typed `EventEmitter` that `Worker` extends,
 * so an application can observe its worker without polling `worker.stats`:
 *
 * ```ts
 * worker.on("claimed", ({ todos }) => console.log("claimed", todos.length));
 * worker.on("settled", ({ todoId, outcome }) => console.log(todoId, outcome));
 * worker.on("error", (error, { rpc, retrying }) => console.warn(rpc, retrying, error.message));
 * ```
 *
 * Every payload can be given to `JSON.stringify` (its messages write the proto3 JSON mapping).
 */
import { EventEmitter } from "node:events";

import { timestampDate, type Timestamp } from "@bufbuild/protobuf/wkt";

import type { DeferralReason, DeferredQueue } from "../gen/switchboard/v1/admission_pb.js";
import type { Doorbell, DoorbellCause } from "../gen/switchboard/v1/dispatch_pb.js";
import type { QueueRef } from "../gen/switchboard/v1/queue_pb.js";
import type { Todo } from "../gen/switchboard/v1/todo_pb.js";
import type { WorkerRpc } from "./stats.js";

/** `claimed`: one `ClaimNext` claimed these todos (their handlers have started). */
export interface ClaimedEvent {
  readonly todos: Todo[];
  /** The queue's admission budget cut the batch short (`deferred` events say which). */
  readonly cutShort: boolean;
}

/**
 * `doorbell`: a `WatchReopen` doorbell rang. UNUSED since the worker waits in held `ClaimNext`
 * calls instead of a `WatchReopen` stream: it never fires (a held claim that claims is told as
 * `claimed`; the server does not say which event woke it). Kept so listeners still compile.
 */
export interface DoorbellEvent {
  /** The queue's name. */
  readonly queue: string;
  /** Its endpoint ("" when the server left it out). */
  readonly endpointId: string;
  readonly cause: DoorbellCause;
  /** When the server rang it. */
  readonly at: Date | undefined;
  /** The message itself (its `pending` count, ...). */
  readonly doorbell: Doorbell;
}

/**
 * How the worker was done with a todo: settled (`completed`, `failed`, `released`), taken
 * from it (`lost`: the lease went stale; `cancelled`: an operator cancelled the todo, its
 * heartbeat or settlement said so), or given up on (`unsettled`: the settlement kept failing
 * until the lease ran out, the reaper takes it back). One per claimed todo, counted in the
 * `worker.stats` counter of the same name.
 */
export type SettledOutcome = "completed" | "failed" | "released" | "lost" | "cancelled" | "unsettled";

/** `settled`: the worker is done with a todo. */
export interface SettledEvent {
  readonly todoId: string;
  readonly outcome: SettledOutcome;
  /** `failed` only: failed permanently (dead-lettered; also counted in `stats.deadLettered`). */
  readonly permanent: boolean;
  /** `failed` only: the handler's error, as sent to the server. */
  readonly error?: string;
}

/** `deferred`: a `ClaimNext` answer listed this queue as deferred by its admission budget. */
export interface DeferredEvent {
  /** The queue's name. */
  readonly queue: string;
  /** Its endpoint ("" when the server left it out). */
  readonly endpointId: string;
  readonly reason: DeferralReason;
  /** When the queue is eligible again, if the server knows. */
  readonly nextEligibleAt: Date | undefined;
  /** Whether `nextEligibleAt` is exact (a window boundary) rather than an estimate. */
  readonly exact: boolean;
  /** The message itself (its `pending` count, ...). */
  readonly detail: DeferredQueue;
}

/** The second argument of an `error` listener: what failed, and whether the worker retries. */
export interface WorkerErrorInfo {
  /** The call that failed (absent when one of the worker's loops died). */
  readonly rpc?: WorkerRpc;
  /**
   * Whether the worker tries again (a transient error). When `false` and `rpc` is
   * `ClaimNext`, `run()` rejects with the same error; otherwise the worker carries on.
   */
  readonly retrying: boolean;
  /** The todos the failed call was about (settlements and heartbeats). */
  readonly todoIds?: readonly string[];
}

/** The worker's events and their listeners' arguments. */
export interface WorkerEventMap {
  claimed: [event: ClaimedEvent];
  /** Never emitted any more: see {@link DoorbellEvent}. */
  doorbell: [event: DoorbellEvent];
  settled: [event: SettledEvent];
  deferred: [event: DeferredEvent];
  /**
   * A call failed (a `ConnectError`), or a loop of the worker died. Unlike a bare
   * `EventEmitter`'s, an `error` nobody listens to is not thrown: the worker logs it and
   * carries on as it always did.
   */
  error: [error: Error, info: WorkerErrorInfo];
}

/** Names and endpoint of a `QueueRef` (either may be empty). */
function queueOf(queue: QueueRef | undefined): { queue: string; endpointId: string } {
  const endpointId = queue?.scope.case === "endpointId" ? queue.scope.value : "";
  return { queue: queue?.name ?? "", endpointId };
}

function dateOf(at: Timestamp | undefined): Date | undefined {
  return at === undefined ? undefined : timestampDate(at);
}

/**
 * A typed `EventEmitter` of {@link WorkerEventMap}. Listeners run synchronously, in the
 * worker's own step; one that throws is logged (through {@link listenerErrorLog}) and does
 * not disturb the worker.
 */
export class WorkerEvents extends EventEmitter<WorkerEventMap> {
  /** Where a listener's exception is reported (the worker sets its log's `error`). */
  protected listenerErrorLog: (message: string) => void = (message) =>
    console.error(`switchboard.worker: ${message}`);

  /** Emits `name` to its listeners, if any; never throws. */
  protected notify<K extends keyof WorkerEventMap>(name: K, ...args: WorkerEventMap[K]): void {
    if (this.listenerCount(name) === 0) return;
    try {
      (this.emit as (name: K, ...args: WorkerEventMap[K]) => boolean)(name, ...args);
    } catch (err) {
      this.listenerErrorLog(`a '${name}' listener threw: ${err instanceof Error ? err.stack ?? err.message : String(err)}`);
    }
  }

  protected notifyClaimed(todos: Todo[], cutShort: boolean): void {
    this.notify("claimed", { todos, cutShort });
  }

  /** Unused by the worker since it holds claims instead of watching doorbells. */
  protected notifyDoorbell(doorbell: Doorbell): void {
    this.notify("doorbell", { ...queueOf(doorbell.queue), cause: doorbell.cause, at: dateOf(doorbell.at), doorbell });
  }

  protected notifySettled(todoId: string, outcome: SettledOutcome, failure?: { permanent: boolean; error: string }): void {
    this.notify("settled", {
      todoId,
      outcome,
      permanent: failure?.permanent ?? false,
      ...(failure !== undefined && { error: failure.error }),
    });
  }

  protected notifyDeferred(deferred: readonly DeferredQueue[]): void {
    for (const detail of deferred) {
      this.notify("deferred", {
        ...queueOf(detail.queue),
        reason: detail.reason,
        nextEligibleAt: dateOf(detail.nextEligibleAt),
        exact: detail.exact,
        detail,
      });
    }
  }

  protected notifyError(error: unknown, info: WorkerErrorInfo): void {
    this.notify("error", error instanceof Error ? error : new Error(String(error)), info);
  }
}
