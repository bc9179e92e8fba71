/**
 * How every part calls the server: {@link Rpc}, the client with the worker's credential and
 * deadline, counting each call in `stats.rpcCalls`.
 */
import { createClient, type Client, type Transport } from "@connectrpc/connect";

import type { MessageInitShape } from "@bufbuild/protobuf";

import {
  DispatchService,
  type ClaimNextRequestSchema,
  type ClaimNextResponse,
} from "../gen/switchboard/v1/dispatch_pb.js";
import type { WorkerRpc, WorkerStats } from "./stats.js";

/** The options of one unary call. */
export interface CallOptions {
  headers: Record<string, string>;
  timeoutMs: number;
  signal: AbortSignal;
}

/** The `DispatchService` client of one worker (the transport is the caller's). */
export class Rpc {
  readonly client: Client<typeof DispatchService>;
  readonly #headers: Record<string, string>;
  readonly #timeoutMs: number;
  readonly #stats: WorkerStats;
  /** Aborts every call in flight at the end of a run. */
  #ending = new AbortController();

  constructor(transport: Transport, token: string | undefined, timeoutMs: number, stats: WorkerStats) {
    this.client = createClient(DispatchService, transport);
    this.#headers = token ? { authorization: `Bearer ${token}` } : {};
    this.#timeoutMs = timeoutMs;
    this.#stats = stats;
  }

  /** A run begins: calls from now on are aborted by {@link end}. */
  begin(): void {
    this.#ending = new AbortController();
  }

  /** The run is over: aborts the calls still in flight. */
  end(): void {
    this.#ending.abort();
  }

  /** One unary call under the worker's deadline. */
  unary<T>(name: WorkerRpc, call: (options: CallOptions) => Promise<T>): Promise<T> {
    this.#stats.rpcCalls[name] += 1;
    return call({ headers: this.#headers, timeoutMs: this.#timeoutMs, signal: this.#ending.signal });
  }

  /**
   * A `ClaimNext` call that `signal` may cancel: its deadline is the request's wait plus the
   * unary deadline, so the server answers before it. (The claimer cancels it on stop, before
   * the run ends.)
   */
  claimNext(
    request: MessageInitShape<typeof ClaimNextRequestSchema>,
    waitMs: number,
    signal: AbortSignal,
  ): Promise<ClaimNextResponse> {
    this.#stats.rpcCalls.ClaimNext += 1;
    return this.client.claimNext(request, { headers: this.#headers, timeoutMs: this.#timeoutMs + waitMs, signal });
  }
}
