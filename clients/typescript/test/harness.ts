/**
 * The tests' real servers: `python -m tests.support.node_server` (see that module), spawned
 * from the repository root with the repo's venv (or $SWITCHBOARD_PYTHON), driven over stdio.
 */
import { spawn, type ChildProcessWithoutNullStreams } from "node:child_process";
import { existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

/** The repository root (this file runs from clients/typescript/build-test/test/). */
export const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");

function python(): string {
  if (process.env.SWITCHBOARD_PYTHON) return process.env.SWITCHBOARD_PYTHON;
  const venv = join(ROOT, ".venv", "bin", "python");
  return existsSync(venv) ? venv : "python3";
}

/** A server started by the harness, with a tenant. */
export interface ServerInfo {
  id: number;
  address: string;
  /** Serves `/metrics`. */
  httpAddress: string;
  operatorToken: string;
  humanToken: string;
  endpointId: string;
  endpointToken: string;
  /** With TLS: PEM files of the test CA and of a client certificate it issued. */
  ca?: string;
  clientCert?: string;
  clientKey?: string;
}

/** The harness process. */
export class Harness {
  #child: ChildProcessWithoutNullStreams;
  #seq = 0;
  #pending = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void }>();
  #ready: Promise<void>;
  stderr: string[] = [];

  private constructor() {
    this.#child = spawn(python(), ["-m", "tests.support.node_server"], {
      cwd: ROOT,
      stdio: ["pipe", "pipe", "pipe"],
    });
    this.#child.stderr.setEncoding("utf8").on("data", (chunk: string) => this.stderr.push(chunk));
    let ready!: () => void;
    let failed!: (e: Error) => void;
    this.#ready = new Promise((res, rej) => {
      ready = res;
      failed = rej;
    });
    this.#child.on("exit", (code) => {
      const error = new Error(`harness exited (${code}):\n${this.stderr.join("")}`);
      failed(error);
      for (const p of this.#pending.values()) p.reject(error);
      this.#pending.clear();
    });
    createInterface({ input: this.#child.stdout }).on("line", (line) => {
      const message = JSON.parse(line) as { ready?: boolean; seq?: number; result?: unknown; error?: string };
      if (message.ready) return ready();
      const pending = this.#pending.get(message.seq ?? -1);
      if (pending === undefined) return;
      this.#pending.delete(message.seq!);
      if (message.error !== undefined) pending.reject(new Error(message.error));
      else pending.resolve(message.result);
    });
  }

  /** Starts the harness and waits until its PostgreSQL is ready. */
  static async start(): Promise<Harness> {
    const harness = new Harness();
    await harness.#ready;
    return harness;
  }

  request<T>(op: string, fields: Record<string, unknown> = {}): Promise<T> {
    const seq = ++this.#seq;
    return new Promise<T>((resolve, reject) => {
      this.#pending.set(seq, { resolve: resolve as (v: unknown) => void, reject });
      this.#child.stdin.write(JSON.stringify({ seq, op, ...fields }) + "\n");
    });
  }

  /**
   * A fresh database and server, with an owner, a human and an endpoint credential; with
   * `tls`, serving TLS (`mutual`: requiring a client certificate).
   */
  server(options: { env?: Record<string, string>; tls?: "server" | "mutual" } = {}): Promise<ServerInfo> {
    return this.request<ServerInfo>("server", { env: options.env ?? {}, tls: options.tls ?? null });
  }

  /** One more server process over server `id`'s database (its replica), as a new server id. */
  replica(id: number): Promise<{ id: number; address: string; httpAddress: string }> {
    return this.request("replica", { id });
  }

  /** Stops a server (SIGTERM); {@link start} brings it back on the same address. */
  kill(id: number): Promise<void> {
    return this.request("kill", { id });
  }

  startAgain(id: number): Promise<string> {
    return this.request("start", { id });
  }

  /** Moves the server's shared clock forward. */
  moveClock(id: number, seconds: number): Promise<string> {
    return this.request("move_clock", { id, seconds });
  }

  setClock(id: number, at: Date): Promise<string> {
    return this.request("set_clock", { id, at: at.toISOString() });
  }

  async now(id: number): Promise<Date> {
    return new Date(await this.request<string>("now", { id }));
  }

  query<T = Record<string, unknown>>(id: number, sql: string): Promise<T[]> {
    return this.request<T[]>("query", { id, sql });
  }

  /** The lines the server wrote to stderr so far, once one of them contains `until` (within 30 s). */
  log(id: number, until: string): Promise<string[]> {
    return this.request<string[]>("log", { id, until });
  }

  /** Closes stdin: the harness stops its servers and PostgreSQL, then exits. */
  async close(): Promise<void> {
    if (this.#child.exitCode !== null) return;
    const exited = new Promise<void>((res) => this.#child.once("exit", () => res()));
    this.#child.stdin.end();
    await exited;
  }
}

/** Waits until `check()` holds, polling every 20 ms; fails after `withinMs`. */
export async function eventually(check: () => boolean, withinMs = 10_000, what = "condition"): Promise<void> {
  const deadline = Date.now() + withinMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`${what} not met within ${withinMs} ms`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

export const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** Silences the worker's log in tests (set SWITCHBOARD_TEST_LOG=1 to see it). */
export const quiet = process.env.SWITCHBOARD_TEST_LOG
  ? undefined
  : { debug() {}, info() {}, warn() {}, error() {} };
