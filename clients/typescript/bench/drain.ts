/**
 * One timed drain by the TypeScript Worker, for bench/ts_worker.py (which seeds the queue and
 * compares it with the Python Worker's on the same server). Settings from the environment:
 * SWITCHBOARD_SERVER, SWITCHBOARD_TOKEN, BENCH_QUEUE, BENCH_TODOS, BENCH_PREFETCH,
 * BENCH_CONCURRENCY. Prints one JSON line: {"seconds", "stats"}.
 */
import { Worker, connect } from "../src/index.js";

const env = (name: string) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};
const queue = env("BENCH_QUEUE");
const todos = Number(env("BENCH_TODOS"));
const prefetch = Number(env("BENCH_PREFETCH"));
const sb = connect({ target: env("SWITCHBOARD_SERVER"), token: env("SWITCHBOARD_TOKEN") });
try {
  await sb.dispatch.listTodos({ queues: [queue], pageSize: 1 }); // connected before the clock starts
  const worker = new Worker({
    transport: sb.transport,
    handler: async () => {},
    queues: [queue],
    claimant: "bench-ts",
    prefetch,
    concurrency: Number(process.env.BENCH_CONCURRENCY || prefetch),
    log: { debug() {}, info() {}, warn: console.error, error: console.error },
  });
  const started = performance.now();
  await worker.run({ maxTodos: todos });
  const seconds = (performance.now() - started) / 1000;
  console.log(JSON.stringify({ seconds, stats: worker.stats }));
} finally {
  await sb.close();
}
