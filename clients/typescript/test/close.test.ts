/**
 * `close()` ends a connection as a client that is done should: calls in flight finish, and
 * the server's log shows no fault. It once called connect-node's `abort()`, which ends the
 * HTTP/2 session with the error code CANCEL; grpc's core then logs
 * `Got goaway [8] err=UNAVAILABLE` on the server's stderr for every client that merely
 * finished. That same abort is the marker here: the connections are used one after the
 * other, each closed before the next opens, so once the marker's line is in the log, a line
 * of the clean close would be there before it.
 */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { createClient } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

import { AdminService, Code, DoorbellCause, bearer, connect, richError } from "../src/index.js";
import { Harness, type ServerInfo } from "./harness.js";

const GOAWAY = "Got goaway";

let harness: Harness;
let server: ServerInfo;

before(async () => {
  harness = await Harness.start();
  server = await harness.server();
});

after(async () => {
  await harness?.close();
});

/**
 * The marker: a connection to `to` ended the old way, with CANCEL; the server's log once
 * that connection's GOAWAY is in it.
 */
async function afterAnAbortedConnection(to: ServerInfo): Promise<string[]> {
  const baseUrl = `http://${to.address}`;
  const manager = new Http2SessionManager(baseUrl);
  const transport = createGrpcTransport({ baseUrl, sessionManager: manager, interceptors: [bearer(to.endpointToken)] });
  await createClient(AdminService, transport).whoAmI({});
  manager.abort();
  return harness.log(to.id, GOAWAY);
}

test("close() lets a call in flight finish, refuses new ones, and the server logs no GOAWAY error", { timeout: 90_000 }, async () => {
  const sb = connect({ target: server.address, token: server.endpointToken });
  const other = connect({ target: server.address, token: server.endpointToken });
  assert.ok((await sb.admin.whoAmI({})).credential);

  // A stream in flight when close() is called: a doorbell subscription, once it is open.
  const stop = new AbortController();
  let subscribed!: () => void;
  const open = new Promise<void>((res) => (subscribed = res));
  const stream = sb.dispatch.watchReopen({ queues: ["bell"] }, { signal: stop.signal, onHeader: () => subscribed() });
  const iterator = stream[Symbol.asyncIterator]();
  const first = iterator.next();
  await open;
  let closedAt: number | undefined;
  const closing = sb.close({ graceMs: 60_000 }).then(() => (closedAt = Date.now()));

  // New calls are refused at once; the open stream still rings.
  await assert.rejects(sb.admin.whoAmI({}), (err) => richError(err).code === Code.Canceled);
  await other.dispatch.ingest({ queue: { name: "bell" }, payload: new TextEncoder().encode("ring") });
  const { value } = await first;
  assert.equal(value?.doorbell?.cause, DoorbellCause.CREATED);
  assert.equal(closedAt, undefined, "close() waits for the stream in flight");
  stop.abort(); // the caller ends its stream: now the connection closes
  await iterator.return?.();
  await closing;
  await sb.close(); // again: harmless
  await other.close();

  const log = await afterAnAbortedConnection(server);
  assert.deepEqual(
    log.filter((line) => line.includes(GOAWAY)).map((line) => line.includes("[8]")),
    [true],
    "only the aborted connection's GOAWAY is logged",
  );
});

test("close() cancels a call still in flight when its grace runs out, still without a GOAWAY error", { timeout: 90_000 }, async () => {
  const fresh = await harness.server();
  const sb = connect({ target: fresh.address, token: fresh.endpointToken });
  let subscribed!: () => void;
  const open = new Promise<void>((res) => (subscribed = res));
  const stream = sb.dispatch.watchReopen({ queues: ["quiet"] }, { onHeader: () => subscribed() });
  const iterator = stream[Symbol.asyncIterator]();
  const cancelled = assert.rejects(iterator.next(), (err) => richError(err).code === Code.Canceled);
  await open;
  await sb.close({ graceMs: 0 });
  await cancelled;

  const log = await afterAnAbortedConnection(fresh);
  assert.equal(log.filter((line) => line.includes(GOAWAY)).length, 1, log.join("\n"));
});
