/**
 * The package README's examples: every `ts` block is type-checked against the built package
 * and run, in order, against a real server; every `sh` block is named here with why it is
 * not run.
 */
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { promisify } from "node:util";

import ts from "typescript";

import { Harness, ROOT, type ServerInfo } from "./harness.js";

const PACKAGE = join(ROOT, "clients", "typescript");
const README = join(PACKAGE, "README.md");

/** The `sh` blocks no test runs, by their first line, and why. */
const NOT_RUN: Record<string, string> = {
  "npm ci --prefix clients/typescript": "CI runs it (.ci/run) before these very tests",
  "cd clients/typescript && npm test": "it is these tests",
  "python -m bench.ts_worker --todos 5000 --rounds 3": "a benchmark of a minute or more; not a test",
};

function blocks(lang: string): string[] {
  const text = readFileSync(README, "utf8");
  const found: string[] = [];
  const fence = new RegExp("^```" + lang + "\\n([\\s\\S]*?)^```", "gm");
  for (const match of text.matchAll(fence)) found.push(match[1]!);
  return found;
}

let harness: Harness;
let server: ServerInfo;

before(async () => {
  harness = await Harness.start();
  server = await harness.server();
});

after(async () => {
  await harness?.close();
});

test("every sh block of the README is listed with why it is not run", () => {
  const firsts = blocks("sh").map((b) => b.split("\n")[0]!.split("#")[0]!.trim());
  assert.deepEqual(firsts.sort(), Object.keys(NOT_RUN).sort());
});

test("the README's ts blocks type-check and run against a real server", async () => {
  const sources = blocks("ts");
  assert.equal(sources.length, 4);
  // Inside the package, so that "@switchboard/client" resolves to it (a self-reference).
  const folder = join(PACKAGE, "build-test", "readme");
  rmSync(folder, { recursive: true, force: true });
  mkdirSync(folder, { recursive: true });
  const files = sources.map((source, i) => {
    const file = join(folder, `block${i + 1}.ts`);
    writeFileSync(file, source);
    return file;
  });
  const program = ts.createProgram(files, {
    target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.NodeNext,
    moduleResolution: ts.ModuleResolutionKind.NodeNext,
    strict: true,
    types: ["node"],
    skipLibCheck: true,
    rootDir: folder,
    outDir: folder,
  });
  const emitted = program.emit();
  const problems = [...ts.getPreEmitDiagnostics(program), ...emitted.diagnostics].map((d) =>
    ts.flattenDiagnosticMessageText(d.messageText, "\n"),
  );
  assert.deepEqual(problems, []);

  const env = {
    ...process.env,
    SWITCHBOARD_SERVER: server.address,
    SWITCHBOARD_TOKEN: server.endpointToken,
    SWITCHBOARD_HUMAN_TOKEN: server.humanToken,
    SWITCHBOARD_ENDPOINT_ID: server.endpointId,
  };
  const outputs: string[] = [];
  for (const file of files) {
    const { stdout } = await promisify(execFile)(process.execPath, [file.replace(/\.ts$/, ".js")], {
      env,
      timeout: 60_000,
    });
    outputs.push(stdout);
  }
  const [quickstart, worker, events, deferral] = outputs as [string, string, string, string];
  assert.match(quickstart, /^working on \d+ hello$/m);
  assert.match(quickstart, /^refused: FailedPrecondition /m);
  assert.equal(worker.match(/^handled \d+ doc \d$/gm)?.length, 3, worker);
  assert.match(worker, /^claimed 3 cut short 1 next window: exact$/m);
  // The events block's worker finds the day's budget spent: a deferred event, no claim.
  assert.match(events, /^deferred summaries WINDOW_EXHAUSTED until \d{4}-\d\d-\d\dT00:00:00\.000Z$/m);
  assert.doesNotMatch(events, /^claimed/m);
  assert.match(deferral, /^deferred: WINDOW_EXHAUSTED until .*\d{4}/m);
  assert.match(deferral, /^retry in \d+ s$/m);
});
