/**
 * Rich errors: the `google.rpc.Status` details a Switchboard server sends in the
 * `grpc-status-details-bin` trailer, decoded into typed messages.
 *
 * ```ts
 * try {
 *   await sb.dispatch.claim({ todoId });
 * } catch (err) {
 *   const e = richError(err);
 *   if (e.deferral) console.log(e.deferral.reason, e.retryDelayMs); // a deferral, not a failure
 * }
 * ```
 */
import { ConnectError, Code } from "@connectrpc/connect";
import { toJson } from "@bufbuild/protobuf";
import { timestampDate, type Duration } from "@bufbuild/protobuf/wkt";

import {
  BadRequestSchema,
  ErrorInfoSchema,
  RetryInfoSchema,
  type BadRequest,
  type ErrorInfo,
  type RetryInfo,
} from "./gen/google/rpc/error_details_pb.js";
import { DeferralDetailSchema, type DeferralDetail } from "./gen/switchboard/v1/admission_pb.js";
import { jsonable } from "./json.js";

export { Code, ConnectError };

/**
 * A failed call, its gRPC code and message, and its decoded details. `JSON.stringify` writes
 * it without the `error` (see {@link richError}).
 */
export interface RichError {
  readonly error: ConnectError;
  readonly code: Code;
  /** The server's message, without the `[code]` prefix. */
  readonly message: string;
  /** `ErrorInfo` (reason and domain), e.g. reason `DEFERRED` on a deferred `Claim`. */
  readonly errorInfo?: ErrorInfo;
  /** Which queue deferred a `Claim`, why, and until when. */
  readonly deferral?: DeferralDetail;
  /** When to try again, when the server knows exactly. */
  readonly retryInfo?: RetryInfo;
  /** `retryInfo.retryDelay` in milliseconds. */
  readonly retryDelayMs?: number;
  /** Which request fields were invalid, and why. */
  readonly badRequest?: BadRequest;
  /** `deferral.nextEligibleAt` as a Date, when the deferral names a time. */
  readonly nextEligibleAt?: Date;
}

/** Milliseconds of a protobuf `Duration`. */
export function durationMs(duration: Duration): number {
  return Number(duration.seconds) * 1000 + duration.nanos / 1e6;
}

/** The details of an error from a call (any thrown value becomes a ConnectError first). */
export function richError(err: unknown): RichError {
  const error = ConnectError.from(err);
  // Each detail message (and the messages in it) can be given to JSON.stringify too.
  const [errorInfo] = error.findDetails(ErrorInfoSchema).map((m) => jsonable(ErrorInfoSchema, m));
  const [deferral] = error.findDetails(DeferralDetailSchema).map((m) => jsonable(DeferralDetailSchema, m));
  const [retryInfo] = error.findDetails(RetryInfoSchema).map((m) => jsonable(RetryInfoSchema, m));
  const [badRequest] = error.findDetails(BadRequestSchema).map((m) => jsonable(BadRequestSchema, m));
  const rich: RichError = {
    error,
    code: error.code,
    message: error.rawMessage,
    ...(errorInfo && { errorInfo }),
    ...(deferral && { deferral }),
    ...(deferral?.nextEligibleAt && { nextEligibleAt: timestampDate(deferral.nextEligibleAt) }),
    ...(retryInfo && { retryInfo }),
    ...(retryInfo?.retryDelay && { retryDelayMs: durationMs(retryInfo.retryDelay) }),
    ...(badRequest && { badRequest }),
  };
  return Object.defineProperty(rich, "toJSON", { value: () => richErrorJson(rich), enumerable: false });
}

/**
 * What `JSON.stringify` writes for a {@link RichError}: the code by name (`Code[name]` reads
 * it back), the message, the details in the proto3 JSON mapping (`fromJson` reads them
 * back), `retryDelayMs`, and `nextEligibleAt` as an ISO string. The `error` itself is left
 * out: its code, message and details are all here.
 */
function richErrorJson(e: RichError): Record<string, unknown> {
  return {
    code: Code[e.code],
    message: e.message,
    ...(e.errorInfo && { errorInfo: toJson(ErrorInfoSchema, e.errorInfo) }),
    ...(e.deferral && { deferral: toJson(DeferralDetailSchema, e.deferral) }),
    ...(e.retryInfo && { retryInfo: toJson(RetryInfoSchema, e.retryInfo) }),
    ...(e.retryDelayMs !== undefined && { retryDelayMs: e.retryDelayMs }),
    ...(e.badRequest && { badRequest: toJson(BadRequestSchema, e.badRequest) }),
    ...(e.nextEligibleAt && { nextEligibleAt: e.nextEligibleAt.toISOString() }),
  };
}

/** Whether `err` is a deferral (`RESOURCE_EXHAUSTED` with `ErrorInfo` reason `DEFERRED`). */
export function isDeferred(err: unknown): boolean {
  const e = richError(err);
  return e.code === Code.ResourceExhausted && e.errorInfo?.reason === "DEFERRED";
}
