/**
 * The Switchboard TypeScript client: a gRPC connection ({@link connect}), rich errors
 * ({@link richError}), the {@link Worker} helper and its events, `JSON.stringify` for the
 * messages it hands out ({@link jsonable}), and the generated messages and services
 * (also importable one file at a time from `@switchboard/client/gen/switchboard/v1/<file>_pb`).
 */
export {
  DEFAULT_CLOSE_GRACE_MS,
  DEFAULT_TARGET,
  MAX_RECEIVE_BYTES,
  MAX_SEND_BYTES,
  bearer,
  connect,
  connectFromEnv,
  createTransport,
  queueRef,
  splitTarget,
  type CloseOptions,
  type ConnectOptions,
  type Connection,
} from "./connection.js";
export { Code, ConnectError, durationMs, isDeferred, richError, type RichError } from "./errors.js";
export {
  MAX_BATCH,
  PermanentFailure,
  TRANSIENT_CODES,
  Worker,
  type Handler,
  type RunOptions,
  type WorkerLogger,
  type WorkerOptions,
} from "./worker/worker.js";
export { WORKER_RPCS, WorkerStats, type WorkerRpc } from "./worker/stats.js";
export {
  WorkerEvents,
  type ClaimedEvent,
  type DeferredEvent,
  type DoorbellEvent,
  type SettledEvent,
  type SettledOutcome,
  type WorkerErrorInfo,
  type WorkerEventMap,
} from "./worker/events.js";
export { jsonable, jsonResponses } from "./json.js";
export * from "./gen/switchboard/v1/admin_pb.js";
export * from "./gen/switchboard/v1/admission_pb.js";
export * from "./gen/switchboard/v1/dispatch_pb.js";
export * from "./gen/switchboard/v1/queue_pb.js";
export * from "./gen/switchboard/v1/schedule_pb.js";
export * from "./gen/switchboard/v1/todo_pb.js";
export * from "./gen/google/rpc/error_details_pb.js";
