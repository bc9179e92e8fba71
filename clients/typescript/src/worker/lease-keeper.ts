/**
 * The lease keeper: the heartbeats that extend every lease held, and lease loss.
 *
 * {@link LeaseKeeper} extends all leases held (and not being settled) together every
 * `heartbeatEveryMs`, with one `Heartbeat` for a single lease or one `HeartbeatTodos` for
 * several. A refusal means the lease is no longer ours (taken over, reaped, or the todo was
 * cancelled): it calls `onLost` for that todo (the handlers abort its handler). A failed call is
 * tried again sooner.
 */
import { Code, ConnectError } from "@connectrpc/connect";

import { BatchItemStatus } from "../gen/switchboard/v1/dispatch_pb.js";
import { TodoState } from "../gen/switchboard/v1/todo_pb.js";
import {
  LEASE_LOST_CODES,
  REFUSED,
  describe,
  msDuration,
  now,
  wasCancelled,
  type Notify,
  type WorkerLogger,
} from "./common.js";
import { waitFor, type Flag } from "./flags.js";
import type { Held, HeldTodos } from "./held.js";
import type { Rpc } from "./rpc.js";

/** Told of a lease lost: the todo, why, and whether because it was cancelled. */
export type OnLost = (held: Held, why: string, cancelled: boolean) => void;

/** Heartbeats of the leases held (see the module docs). */
export class LeaseKeeper {
  constructor(
    private readonly rpc: Rpc,
    private readonly held: HeldTodos,
    private readonly leaseMs: number,
    private readonly everyMs: number,
    private readonly onLost: OnLost,
    private readonly log: WorkerLogger,
    private readonly notify: Notify,
  ) {}

  /** Extends every lease held, when the oldest extension is due; until `ending` is set. */
  async run(ending: Flag): Promise<void> {
    let retryAt = 0;
    while (!ending.isSet) {
      const beating = this.held.beating();
      if (beating.length === 0) {
        this.held.added.clear();
        await waitFor(null, this.held.added, ending);
        continue;
      }
      const due = Math.max(Math.min(...beating.map((h) => h.extendedAt)) + this.everyMs, retryAt);
      const delay = due - now();
      if (delay > 0) {
        await waitFor(delay, ending);
        continue;
      }
      if (await this.#beat(beating, ending)) retryAt = 0;
      else retryAt = now() + Math.min(this.everyMs, 1000); // try again sooner; they may still be ours
    }
  }

  /** One heartbeat call for `beating`; whether the server answered for each. */
  async #beat(beating: Held[], ending: Flag): Promise<boolean> {
    const sent = now();
    const leaseDuration = msDuration(this.leaseMs);
    const client = this.rpc.client;
    if (beating.length === 1) {
      const held = beating[0]!;
      try {
        await this.rpc.unary("Heartbeat", (o) =>
          client.heartbeat({ todoId: held.todoId, leaseId: held.leaseId, leaseDuration }, o),
        );
      } catch (err) {
        if (ending.isSet) return true;
        const e = ConnectError.from(err);
        if (LEASE_LOST_CODES.has(e.code)) {
          this.onLost(held, e.rawMessage || Code[e.code], wasCancelled(e));
          return true;
        }
        this.log.warn(`heartbeat failed (${describe(e)})`);
        this.notify.error(e, { rpc: "Heartbeat", retrying: true, todoIds: [held.todoId] });
        return false;
      }
      this.held.extended(held, sent);
      return true;
    }
    let results: Map<string, { status: BatchItemStatus; message: string; state: TodoState }>;
    try {
      const leases = beating.map((h) => ({ todoId: h.todoId, leaseId: h.leaseId }));
      const response = await this.rpc.unary("HeartbeatTodos", (o) => client.heartbeatTodos({ leases, leaseDuration }, o));
      results = new Map(response.results.map((r) => [r.todoId, r]));
    } catch (err) {
      if (ending.isSet) return true;
      this.log.warn(`heartbeat of ${beating.length} leases failed (${describe(err)})`);
      this.notify.error(ConnectError.from(err), {
        rpc: "HeartbeatTodos",
        retrying: true,
        todoIds: beating.map((h) => h.todoId),
      });
      return false;
    }
    let answered = true;
    for (const held of beating) {
      const result = results.get(held.todoId);
      if (result?.status === BatchItemStatus.APPLIED) this.held.extended(held, sent);
      else if (result !== undefined && REFUSED.has(result.status)) {
        this.onLost(held, result.message || BatchItemStatus[result.status], result.state === TodoState.CANCELLED);
      } else answered = false; // left out, or a status this client does not know
    }
    return answered;
  }
}
