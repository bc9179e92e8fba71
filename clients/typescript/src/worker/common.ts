/**
 * What every part of the worker shares: the public types handlers see ({@link Handler},
 * {@link PermanentFailure}, {@link WorkerLogger}), the batch limits, the retry and lost-lease
 * codes, how the parts tell the worker's events ({@link Notify}), and small conversions.
 */
import { Code, ConnectError } from "@connectrpc/connect";

import { MAX_SEND_BYTES } from "../connection.js";
import type { DeferredQueue } from "../gen/switchboard/v1/admission_pb.js";
import { ErrorInfoSchema } from "../gen/google/rpc/error_details_pb.js";
import { BatchItemStatus } from "../gen/switchboard/v1/dispatch_pb.js";
import type { Todo } from "../gen/switchboard/v1/todo_pb.js";
import type { SettledOutcome, WorkerErrorInfo } from "./events.js";

/** Most todos one `ClaimNext` may claim, and most items of a batch call (the server's limit). */
export const MAX_BATCH = 500;

/** Most encoded bytes of settlements one `SettleTodos` call carries: the server's request limit
 * less a margin for the rest of the request. */
export const MAX_BATCH_BYTES = MAX_SEND_BYTES - 64 * 1024;

/** The longest the server holds a `ClaimNext` (`ClaimNextRequest.wait`). */
export const MAX_WAIT_MS = 60_000;

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
export const LEASE_LOST_CODES: ReadonlySet<Code> = new Set([Code.FailedPrecondition, Code.NotFound]);

/**
 * Whether a refused lease call says the todo was cancelled (`CancelTodo`): `FAILED_PRECONDITION`
 * with `ErrorInfo` reason `TODO_CANCELLED`.
 */
export function wasCancelled(err: ConnectError): boolean {
  return (
    err.code === Code.FailedPrecondition &&
    err.findDetails(ErrorInfoSchema).some((info) => info.reason === "TODO_CANCELLED")
  );
}

/** Per-item refusals of a batch call: the lease is no longer ours. */
export const REFUSED: ReadonlySet<BatchItemStatus> = new Set([
  BatchItemStatus.STALE_LEASE,
  BatchItemStatus.NOT_CLAIMED,
  BatchItemStatus.NOT_FOUND,
]);

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

export const defaultLogger: WorkerLogger = {
  debug: () => {},
  info: () => {},
  warn: (m) => console.warn(`switchboard.worker: ${m}`),
  error: (m) => console.error(`switchboard.worker: ${m}`),
};

/** How the parts tell the worker's events (the worker emits them; see `events.ts`). */
export interface Notify {
  claimed(todos: Todo[], cutShort: boolean): void;
  settled(todoId: string, outcome: SettledOutcome, failure?: { permanent: boolean; error: string }): void;
  deferred(deferred: readonly DeferredQueue[]): void;
  error(error: unknown, info: WorkerErrorInfo): void;
}

/** The local monotonic clock, in milliseconds. */
export const now = (): number => performance.now();

/** A handler's error as the text `Fail` sends. */
export function errorText(err: unknown): string {
  let text: string;
  if (err instanceof Error) text = err.message ? `${err.name}: ${err.message}` : err.name;
  else text = String(err);
  return text.slice(0, MAX_ERROR_TEXT);
}

/** A call's error as a log line's words: `Unavailable: ...`. */
export function describe(err: unknown): string {
  const e = ConnectError.from(err);
  return `${Code[e.code]}: ${e.rawMessage}`;
}

/** A protobuf `Duration` init of `ms` milliseconds. */
export function msDuration(ms: number): { seconds: bigint; nanos: number } {
  const seconds = Math.floor(ms / 1000);
  return { seconds: BigInt(seconds), nanos: Math.round((ms - seconds * 1000) * 1e6) };
}
