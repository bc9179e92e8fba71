/**
 * Connections to a Switchboard server: a gRPC (HTTP/2) transport, over TLS when the
 * server serves TLS, with the bearer token on every call.
 *
 * ```ts
 * const sb = connect({ target: "127.0.0.1:50051", token: "sbe_..." }); // plaintext
 * const tls = connect({ target: "sb.internal:50051", cacert: "ca.pem", cert: "me.crt", key: "me.key" });
 * await sb.dispatch.ingest({ queue: { name: "work" }, payload: new TextEncoder().encode("hi") });
 * await sb.close(); // waits for calls in flight, then ends the connection cleanly
 * ```
 *
 * Like the Python `switchboard_dispatch.connect.channel`: a connection is TLS when any of
 * `cacert`, `cert`, `key` is given, when `tls` is true, or when the target starts with
 * `https://` (port 443 by default then). Without `cacert` a TLS connection trusts Node's
 * default roots. `cert` and `key` (mutual TLS) go together. Files are PEM, read once here.
 * Every message a call answers with can be given to `JSON.stringify` (see `json.ts`).
 */
import { readFileSync } from "node:fs";
import * as http2 from "node:http2";

import type { MessageInitShape } from "@bufbuild/protobuf";
import {
  Code,
  ConnectError,
  createClient,
  type Client,
  type Interceptor,
  type Transport,
} from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

import { AdminService } from "./gen/switchboard/v1/admin_pb.js";
import { AdmissionService } from "./gen/switchboard/v1/admission_pb.js";
import { DispatchService } from "./gen/switchboard/v1/dispatch_pb.js";
import { ScheduleService } from "./gen/switchboard/v1/schedule_pb.js";
import type { QueueRefSchema } from "./gen/switchboard/v1/queue_pb.js";
import { jsonResponses } from "./json.js";

/** Where a server listens by default. */
export const DEFAULT_TARGET = "127.0.0.1:50051";

/**
 * The largest message a connection receives: more than the largest answer the server
 * sends (a page of 500 todos with every field at its limit is about 10 MiB), as in the
 * Python client's `switchboard_dispatch.connect.MAX_RECEIVE_BYTES`.
 */
export const MAX_RECEIVE_BYTES = 16 * 1024 * 1024;

/**
 * The largest request the server receives (its `MAX_REQUEST_BYTES`): the largest payload plus
 * 64 KiB; a larger one is refused with `ResourceExhausted`. As the Python client's
 * `switchboard_dispatch.connect.MAX_SEND_BYTES`.
 */
export const MAX_SEND_BYTES = 1024 * 1024 + 64 * 1024;

/** How to reach a server. */
export interface ConnectOptions {
  /** `host:port` (plaintext unless a TLS option is given) or `https://host[:port]`. */
  target?: string;
  /** A bearer token sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** PEM file of the CA that signed the server's certificate (implies TLS). */
  cacert?: string;
  /** PEM client certificate for a server that requires mutual TLS (with `key`). */
  cert?: string;
  /** PEM private key of `cert`. */
  key?: string;
  /** TLS against Node's default roots, without a `cacert`. */
  tls?: boolean;
  /** Check the server's certificate for this name instead of the target's host. */
  serverName?: string;
  /** The deadline of every call, unless the call passes its own `timeoutMs`. */
  timeoutMs?: number;
  /** More interceptors (after the one that adds the token). */
  interceptors?: Interceptor[];
}

/** How {@link Connection.close} treats calls in flight. */
export interface CloseOptions {
  /**
   * How long calls in flight may take to finish before they are cancelled (5000 ms by
   * default; 0 cancels them at once). A stream that runs until told otherwise, such as a
   * `watchReopen` doorbell, is cancelled when this runs out.
   */
  graceMs?: number;
}

/** A transport and the clients of the four services over it. */
export interface Connection {
  readonly transport: Transport;
  readonly dispatch: Client<typeof DispatchService>;
  readonly admission: Client<typeof AdmissionService>;
  readonly admin: Client<typeof AdminService>;
  readonly schedules: Client<typeof ScheduleService>;
  /**
   * Closes the HTTP/2 connection cleanly: new calls fail with `canceled` at once, calls
   * in flight get `graceMs` to finish (then each is cancelled on its own stream), and the
   * connection ends with a GOAWAY that says NO_ERROR, so the server sees a client that
   * left, not a fault. Resolves once the socket is closed; calling it again is harmless.
   */
  close(options?: CloseOptions): Promise<void>;
}

/** Calls in flight may take this long to finish when a connection closes. */
export const DEFAULT_CLOSE_GRACE_MS = 5000;

/**
 * connect-node's session manager with a clean close. Its own `abort()` destroys the session
 * with the HTTP/2 error code CANCEL, which grpc's server logs as a fault
 * (`Got goaway [8] err=UNAVAILABLE`) for every client that merely finished. This one keeps
 * the streams and sessions it opened, so that {@link close} can let the streams finish (or
 * cancel them one by one) and then close each session with NO_ERROR.
 */
class ClosingSessionManager extends Http2SessionManager {
  #streams = new Set<http2.ClientHttp2Stream>();
  #sessions = new Set<http2.ClientHttp2Session>();
  #closing: Promise<void> | undefined;

  override async request(
    method: string,
    path: string,
    headers: http2.OutgoingHttpHeaders,
    options: Omit<http2.ClientSessionRequestOptions, "signal">,
  ): Promise<http2.ClientHttp2Stream> {
    if (this.#closing !== undefined) throw new ConnectError("the connection is closed", Code.Canceled);
    const stream = await super.request(method, path, headers, options);
    this.#streams.add(stream);
    stream.once("close", () => this.#streams.delete(stream));
    const session = stream.session as http2.ClientHttp2Session | undefined;
    if (session !== undefined && !this.#sessions.has(session)) {
      this.#sessions.add(session);
      session.once("close", () => this.#sessions.delete(session));
    }
    return stream;
  }

  close(graceMs: number): Promise<void> {
    this.#closing ??= this.#close(graceMs);
    return this.#closing;
  }

  async #close(graceMs: number): Promise<void> {
    const finished = Promise.all([...this.#streams].map((stream) => closed(stream)));
    let timer: NodeJS.Timeout | undefined;
    const graceOver = new Promise<void>((res) => (timer = setTimeout(res, Math.max(0, graceMs))));
    await Promise.race([finished, graceOver]);
    clearTimeout(timer);
    for (const stream of this.#streams) stream.close(http2.constants.NGHTTP2_CANCEL);
    // close(): no new streams, a GOAWAY with NO_ERROR, the socket ends once the streams have.
    await Promise.all(
      [...this.#sessions].map((session) => {
        const done = closed(session);
        session.ref(); // an idle session is unref'd: the process must wait for its goodbye
        session.close();
        return done;
      }),
    );
    this.abort(); // nothing is left open: this only resets the manager's state
  }
}

/** Resolves once a stream or session has emitted `close` (at once if it is destroyed). */
function closed(what: http2.ClientHttp2Stream | http2.ClientHttp2Session): Promise<void> {
  if (what.destroyed) return Promise.resolve();
  return new Promise((res) => what.once("close", () => res()));
}

/** `[host:port, tls]` of a target: `https://host[:port]` means TLS (port 443 by default). */
export function splitTarget(target: string): [string, boolean] {
  if (target.startsWith("https://")) {
    const rest = target.slice("https://".length).replace(/\/+$/, "");
    const afterBracket = rest.split("]").pop() ?? rest;
    return [afterBracket.includes(":") ? rest : `${rest}:443`, true];
  }
  return [target, false];
}

function read(what: string, path: string): Buffer {
  try {
    return readFileSync(path);
  } catch (err) {
    const reason = err instanceof Error ? err.message : String(err);
    throw new Error(`cannot read the ${what} ${path}: ${reason}`);
  }
}

/** An interceptor that sends `authorization: Bearer <token>` (unless the call set one). */
export function bearer(token: string): Interceptor {
  return (next) => (req) => {
    if (!req.header.has("authorization")) req.header.set("authorization", `Bearer ${token}`);
    return next(req);
  };
}

/** A gRPC transport to a server (see the module docs) and a way to close it (see {@link Connection.close}). */
export function createTransport(options: ConnectOptions = {}): {
  transport: Transport;
  close: (options?: CloseOptions) => Promise<void>;
} {
  const [address, https] = splitTarget(options.target ?? DEFAULT_TARGET);
  const { cacert, cert, key } = options;
  const secure = Boolean(options.tls || https || cacert || cert || key);
  if ((cert === undefined) !== (key === undefined)) {
    throw new Error("a client certificate needs its key and a key its certificate");
  }
  if (!secure && options.serverName !== undefined) throw new Error("serverName needs TLS");
  const baseUrl = `${secure ? "https" : "http"}://${address}`;
  const nodeOptions: http2.SecureClientSessionOptions = {};
  if (secure) {
    if (cacert !== undefined) nodeOptions.ca = read("CA certificate", cacert);
    if (cert !== undefined && key !== undefined) {
      nodeOptions.cert = read("client certificate", cert);
      nodeOptions.key = read("client key", key);
    }
    if (options.serverName !== undefined) nodeOptions.servername = options.serverName;
  }
  const sessionManager = new ClosingSessionManager(baseUrl, {}, nodeOptions);
  const interceptors = [
    ...(options.token !== undefined ? [bearer(options.token)] : []),
    ...(options.interceptors ?? []),
    // Innermost: the caller's interceptors see answers that JSON.stringify can write.
    jsonResponses,
  ];
  const transport = createGrpcTransport({
    baseUrl,
    sessionManager,
    interceptors,
    readMaxBytes: MAX_RECEIVE_BYTES,
    ...(options.timeoutMs !== undefined ? { defaultTimeoutMs: options.timeoutMs } : {}),
  });
  return {
    transport,
    close: (closing: CloseOptions = {}) => sessionManager.close(closing.graceMs ?? DEFAULT_CLOSE_GRACE_MS),
  };
}

/** A transport and the four service clients (see the module docs). */
export function connect(options: ConnectOptions = {}): Connection {
  const { transport, close } = createTransport(options);
  return {
    transport,
    dispatch: createClient(DispatchService, transport),
    admission: createClient(AdmissionService, transport),
    admin: createClient(AdminService, transport),
    schedules: createClient(ScheduleService, transport),
    close,
  };
}

/**
 * {@link connect} from `SWITCHBOARD_SERVER` (default `127.0.0.1:50051`), `SWITCHBOARD_CACERT`,
 * `SWITCHBOARD_CERT`, `SWITCHBOARD_KEY` and `SWITCHBOARD_TOKEN`, the `switchboard` command's settings.
 */
export function connectFromEnv(
  env: Record<string, string | undefined> = process.env,
  options: ConnectOptions = {},
): Connection {
  const pick = (name: string) => env[name] || undefined;
  const fromEnv: ConnectOptions = { target: pick("SWITCHBOARD_SERVER") ?? DEFAULT_TARGET };
  for (const [field, name] of [
    ["cacert", "SWITCHBOARD_CACERT"],
    ["cert", "SWITCHBOARD_CERT"],
    ["key", "SWITCHBOARD_KEY"],
    ["token", "SWITCHBOARD_TOKEN"],
  ] as const) {
    const value = pick(name);
    if (value !== undefined) fromEnv[field] = value;
  }
  return connect({ ...fromEnv, ...options });
}

/**
 * A `QueueRef` init: the queue `name` of `endpointId` (leave it out for an endpoint
 * credential's own endpoint; human tokens must name it).
 */
export function queueRef(name: string, endpointId?: string): MessageInitShape<typeof QueueRefSchema> {
  return endpointId ? { name, scope: { case: "endpointId", value: endpointId } } : { name };
}
