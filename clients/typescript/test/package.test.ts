/**
 * The package as a user gets it: `npm pack`ed, unpacked into a throwaway project's
 * node_modules, then loaded with `import` and with `require` (the root and the `./gen/*`
 * subpath), type-checked from an `.mts` and a `.cts` file, and run against a real server.
 * And its license agrees with the repository's.
 */
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { promisify } from "node:util";

import ts from "typescript";

import { Harness, ROOT, type ServerInfo } from "./harness.js";

const run = promisify(execFile);
const PACKAGE = join(ROOT, "clients", "typescript");
const TEST_TIMEOUT = 120_000;

interface PackageJson {
  name: string;
  license?: string;
  private?: boolean;
  dependencies: Record<string, string>;
}

const pkg = JSON.parse(readFileSync(join(PACKAGE, "package.json"), "utf8")) as PackageJson;

/** What each script prints: which file the package resolved to, and what it found in it. */
const PROBE = `
  const facts = {
    resolved: RESOLVE("@switchboard/client"),
    gen: RESOLVE("@switchboard/client/gen/switchboard/v1/dispatch_pb"),
    worker: typeof client.Worker,
    connect: typeof client.connect,
    service: gen.DispatchService.typeName,
    sameSchema: gen.DispatchService === client.DispatchService,
  };
  const sb = client.connect({ target: process.env.SWITCHBOARD_SERVER, token: process.env.SWITCHBOARD_TOKEN });
  const answer = await sb.dispatch.ingest({ queue: { name: "packaged" }, payload: new Uint8Array([1, 2]) });
  facts.ingested = JSON.parse(JSON.stringify(answer)).todo.payload;
  try {
    await sb.dispatch.complete({ todoId: answer.todo.id, leaseId: "00000000-0000-0000-0000-000000000000" });
  } catch (err) {
    facts.refused = client.Code[client.richError(err).code];
  }
  await sb.close();
  console.log(JSON.stringify(facts));
`;

const ESM = `
import * as client from "@switchboard/client";
import * as gen from "@switchboard/client/gen/switchboard/v1/dispatch_pb";
const RESOLVE = (name) => import.meta.resolve(name);
${PROBE}
`;

const CJS = `
const client = require("@switchboard/client");
const gen = require("@switchboard/client/gen/switchboard/v1/dispatch_pb");
const RESOLVE = (name) => "file://" + require.resolve(name);
(async () => {
${PROBE}
})().catch((err) => { console.error(err); process.exit(1); });
`;

/** One application that loads both builds: the two copies of PermanentFailure know each other. */
const MIXED = `
import { createRequire } from "node:module";
import { PermanentFailure } from "@switchboard/client";
const cjs = createRequire(import.meta.url)("@switchboard/client");
console.log(JSON.stringify({
  twoCopies: cjs.PermanentFailure !== PermanentFailure,
  esmKnowsCjs: new cjs.PermanentFailure("x") instanceof PermanentFailure,
  cjsKnowsEsm: new PermanentFailure("x") instanceof cjs.PermanentFailure,
  plainError: new Error("x") instanceof PermanentFailure,
}));
`;

/** The same, typed: what a TypeScript user compiles against each build's declarations. */
const TYPED = {
  "typed.mts": `
import { connect, Worker, type Todo, type SettledEvent } from "@switchboard/client";
import { DispatchService } from "@switchboard/client/gen/switchboard/v1/dispatch_pb";
export const handler = async (todo: Todo): Promise<void> => void todo.id;
export const make = (): Worker => new Worker({ transport: connect().transport, handler, claimant: "x" });
export const listen = (w: Worker) => w.on("settled", (e: SettledEvent) => void e.outcome);
export const name: string = DispatchService.typeName;
`,
  "typed.cts": `
import client = require("@switchboard/client");
import gen = require("@switchboard/client/gen/switchboard/v1/dispatch_pb");
export const handler = async (todo: client.Todo): Promise<void> => void todo.id;
export const make = (): client.Worker =>
  new client.Worker({ transport: client.connect().transport, handler, claimant: "x" });
export const listen = (w: client.Worker) => w.on("settled", (e: client.SettledEvent) => void e.outcome);
export const name: string = gen.DispatchService.typeName;
`,
};

describe("the packed package, from import and from require", () => {
  let harness: Harness;
  let server: ServerInfo;
  let project: string;
  let installed: string;

  before(async () => {
    harness = await Harness.start();
    server = await harness.server();
    project = mkdtempSync(join(tmpdir(), "switchboard-client-"));
    // What `npm install <tarball>` puts in node_modules: the packed files. The dependencies
    // are this package's own installed ones (the test needs no registry).
    const { stdout } = await run("npm", ["pack", "--ignore-scripts", "--json", "--pack-destination", project], {
      cwd: PACKAGE,
    });
    const [packed] = JSON.parse(stdout) as Array<{ filename: string; files: Array<{ path: string }> }>;
    installed = join(project, "node_modules", "@switchboard", "client");
    mkdirSync(installed, { recursive: true });
    await run("tar", ["-xzf", join(project, packed!.filename), "-C", installed, "--strip-components=1"]);
    for (const scope of new Set(Object.keys(pkg.dependencies).map((d) => d.split("/")[0]!).concat("@types"))) {
      symlinkSync(join(PACKAGE, "node_modules", scope), join(project, "node_modules", scope), "dir");
    }
    writeFileSync(join(project, "package.json"), JSON.stringify({ name: "user", private: true }));
    writeFileSync(join(project, "use.mjs"), ESM);
    writeFileSync(join(project, "use.cjs"), CJS);
    writeFileSync(join(project, "mixed.mjs"), MIXED);
    for (const [name, source] of Object.entries(TYPED)) writeFileSync(join(project, name), source);
  });

  after(async () => {
    await harness?.close();
    if (project) rmSync(project, { recursive: true, force: true });
  });

  async function probe(script: string): Promise<Record<string, unknown>> {
    const env = { ...process.env, SWITCHBOARD_SERVER: server.address, SWITCHBOARD_TOKEN: server.endpointToken };
    const { stdout } = await run(process.execPath, [script], { cwd: project, env, timeout: 60_000 });
    return JSON.parse(stdout) as Record<string, unknown>;
  }

  const expected = { worker: "function", connect: "function", service: "switchboard.v1.DispatchService", sameSchema: true, ingested: "AQI=", refused: "FailedPrecondition" };

  test("import: the ESM build, root and ./gen/*, runs against a server", { timeout: TEST_TIMEOUT }, async () => {
    const facts = await probe("use.mjs");
    assert.equal(facts.resolved, `file://${installed}/dist/index.js`);
    assert.equal(facts.gen, `file://${installed}/dist/gen/switchboard/v1/dispatch_pb.js`);
    assert.deepEqual({ ...facts, resolved: undefined, gen: undefined }, { ...expected, resolved: undefined, gen: undefined });
  });

  test("require: the CommonJS build, root and ./gen/*, runs against a server", { timeout: TEST_TIMEOUT }, async () => {
    const facts = await probe("use.cjs");
    assert.equal(facts.resolved, `file://${installed}/dist/cjs/index.js`);
    assert.equal(facts.gen, `file://${installed}/dist/cjs/gen/switchboard/v1/dispatch_pb.js`);
    assert.deepEqual({ ...facts, resolved: undefined, gen: undefined }, { ...expected, resolved: undefined, gen: undefined });
  });

  test("both in one application: two copies, and PermanentFailure is recognised across them", { timeout: TEST_TIMEOUT }, async () => {
    assert.deepEqual(await probe("mixed.mjs"), { twoCopies: true, esmKnowsCjs: true, cjsKnowsEsm: true, plainError: false });
  });

  test("types: an .mts file gets the ESM declarations, a .cts file the CommonJS ones", () => {
    const files = Object.keys(TYPED).map((name) => join(project, name));
    const options: ts.CompilerOptions = {
      target: ts.ScriptTarget.ES2022,
      module: ts.ModuleKind.NodeNext,
      moduleResolution: ts.ModuleResolutionKind.NodeNext,
      strict: true,
      noEmit: true,
      types: ["node"],
      typeRoots: [join(project, "node_modules", "@types")],
    };
    const program = ts.createProgram(files, options);
    const problems = ts.getPreEmitDiagnostics(program).map((d) => ts.flattenDiagnosticMessageText(d.messageText, "\n"));
    assert.deepEqual(problems, []);
    const resolved = (file: string, mode: ts.ResolutionMode) =>
      ts.resolveModuleName("@switchboard/client", file, options, ts.sys, undefined, undefined, mode).resolvedModule
        ?.resolvedFileName;
    assert.equal(resolved(files[0]!, ts.ModuleKind.ESNext), join(installed, "dist", "index.d.ts"));
    assert.equal(resolved(files[1]!, ts.ModuleKind.CommonJS), join(installed, "dist", "cjs", "index.d.ts"));
  });
});

/** The value of `license = ...` in a pyproject.toml's [project] table (a string or `{ text = ... }`). */
function pyprojectLicense(file: string): string | undefined {
  const text = readFileSync(file, "utf8");
  const project = /^\[project\]\n([\s\S]*?)(?=^\[|(?![\s\S]))/m.exec(text)?.[1] ?? "";
  const line = /^license\s*=\s*(.+)$/m.exec(project)?.[1]?.trim();
  if (line === undefined) return undefined;
  return /"([^"]*)"/.exec(line)?.[1] ?? line;
}

const LICENSE_FILES = ["LICENSE", "LICENSE.md", "LICENSE.txt", "COPYING"];

test("the package's license agrees with the repository's", async () => {
  const rootFile = LICENSE_FILES.find((name) => existsSync(join(ROOT, name)));
  const packageFile = LICENSE_FILES.find((name) => existsSync(join(PACKAGE, name)));
  const declared = [join(ROOT, "pyproject.toml"), join(ROOT, "clients", "python", "pyproject.toml")].map(pyprojectLicense);
  const rootPackage = JSON.parse(readFileSync(join(ROOT, "package.json"), "utf8")) as PackageJson;
  // The Python distributions agree with each other and with the root's npm manifest.
  assert.equal(new Set(declared).size, 1, `pyproject licenses: ${declared.join(", ")}`);
  const [spdx] = declared;
  if (rootFile === undefined && spdx === undefined) {
    // No license anywhere: all rights reserved. npm says so with UNLICENSED (and private:
    // true keeps it off a registry); a LICENSE file would grant what the repository does not.
    assert.equal(pkg.license, "UNLICENSED");
    assert.equal(pkg.private, true);
    assert.equal(rootPackage.license, "UNLICENSED");
    assert.equal(packageFile, undefined, "the package has a license file the repository has not");
    return;
  }
  assert.equal(pkg.license, spdx ?? `SEE LICENSE IN ${packageFile}`);
  assert.equal(rootPackage.license, pkg.license);
  assert.ok(rootFile && packageFile, "the repository's license file is copied into the package");
  assert.equal(readFileSync(join(PACKAGE, packageFile), "utf8"), readFileSync(join(ROOT, rootFile), "utf8"));
  const { stdout } = await run("npm", ["pack", "--dry-run", "--ignore-scripts", "--json"], { cwd: PACKAGE });
  const [packed] = JSON.parse(stdout) as Array<{ files: Array<{ path: string }> }>;
  assert.ok(packed!.files.some((f) => f.path === packageFile), "npm pack ships the license file");
});
