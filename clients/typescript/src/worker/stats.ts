/** The worker's counters: {@link WorkerStats} (`worker.stats`), as in the Python helper. */

/** The RPCs the worker makes, each counted in {@link WorkerStats.rpcCalls}. */
export const WORKER_RPCS = [
  "ClaimNext",
  "Heartbeat",
  "HeartbeatTodos",
  "Complete",
  "Fail",
  "Release",
  "SettleTodos",
  "WatchReopen",
] as const;

/** One of {@link WORKER_RPCS}. */
export type WorkerRpc = (typeof WORKER_RPCS)[number];

/**
 * What a worker has done so far (counters only ever grow).
 *
 * Every claimed todo ends up in exactly one of `completed`, `failed`, `released`, `lost`,
 * `cancelled` or `unsettled` (once settled; see `worker.held`). Deferrals are counted in `deferredWaits`,
 * never in `failed`.
 */
export class WorkerStats {
  /** Todos claimed (committed claims). */
  claimed = 0;
  /** `ClaimNext` calls that claimed at least one todo (`claimed / batches` is the mean batch). */
  batches = 0;
  /** Of `batches`, those the queue's admission budget cut short (a deferral, not a failure). */
  cutShort = 0;
  /** Todos completed. */
  completed = 0;
  /** Todos failed because the handler threw (including permanent failures). */
  failed = 0;
  /** Of `failed`, those failed permanently (dead-lettered at once). */
  deadLettered = 0;
  /** Todos given back with a release (their handlers were aborted on shutdown). */
  released = 0;
  /**
   * Todos whose lease went stale while the worker held them: taken over, reaped or settled by
   * someone else. Their handlers were aborted or their settlements refused.
   */
  lost = 0;
  /**
   * Todos cancelled (`CancelTodo`) while the worker held them: a heartbeat came back refused as
   * cancelled and the handler was aborted, or the settlement was refused as cancelled. Nothing
   * more is sent for them.
   */
  cancelled = 0;
  /** Todos the worker gave up settling (the call kept failing until the lease ran out). */
  unsettled = 0;
  /**
   * Empty `ClaimNext` answers that listed deferred queues: a held claim whose wait ended while
   * admission deferred the work there is (or, with `stopWhenIdle`, the last claim).
   */
  deferredWaits = 0;
  /** Empty `ClaimNext` answers with nothing deferred (no work at all). */
  idleWaits = 0;
  /**
   * Always 0: the worker opens no `WatchReopen` stream any more (its held claims are woken by
   * the events that ring doorbells); kept for old readers.
   */
  doorbells = 0;
  /** RPCs started, by method name, retries included (`WatchReopen` stays 0: kept for old readers). */
  rpcCalls: Record<WorkerRpc, number> = Object.fromEntries(
    WORKER_RPCS.map((name) => [name, 0]),
  ) as Record<WorkerRpc, number>;
}
