// Builds the console into dist/: esbuild bundles src/main.js and
// src/app.css into content-hashed files under dist/assets/, index.html
// names them, and dist/manifest.json records a hash of every source
// (sourceHash) so the gateway's TestConsoleDistIsCurrent can tell a dist/
// older than its sources without npm. The hash's recipe is written twice,
// here and in services/gateway/console_test.go: change both together.
import { build } from "esbuild";
import { createHash } from "node:crypto";
import { readFileSync, readdirSync, rmSync, mkdirSync, writeFileSync, statSync } from "node:fs";
import { join, relative } from "node:path";
import { gzipSync } from "node:zlib";

const root = new URL(".", import.meta.url).pathname;

// sources are the files the bundle is made from: src/ and the build's
// own inputs. Paths are relative, with "/", sorted bytewise.
function sources() {
  const out = ["build.mjs", "package.json", "package-lock.json"];
  const walk = (dir) => {
    for (const name of readdirSync(join(root, dir))) {
      const p = dir + "/" + name;
      if (statSync(join(root, p)).isDirectory()) walk(p);
      else out.push(p);
    }
  };
  walk("src");
  return out.sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
}

// sourceHash is SHA-256 over "<path>\n<length>\n<bytes>" of each source.
function sourceHash() {
  const h = createHash("sha256");
  for (const p of sources()) {
    const b = readFileSync(join(root, p));
    h.update(p + "\n" + b.length + "\n");
    h.update(b);
  }
  return h.digest("hex");
}

const dist = join(root, "dist");
rmSync(dist, { recursive: true, force: true });
mkdirSync(join(dist, "assets"), { recursive: true });

const result = await build({
  absWorkingDir: root,
  entryPoints: { app: "src/main.js", style: "src/app.css" },
  bundle: true,
  minify: true,
  format: "esm",
  target: ["es2020", "chrome100", "firefox100", "safari15"],
  outdir: "dist/assets",
  entryNames: "[name]-[hash]",
  metafile: true,
  legalComments: "none",
  logLevel: "warning",
});

const outputs = Object.keys(result.metafile.outputs).map((p) => relative(dist, join(root, p)));
const js = outputs.find((p) => p.endsWith(".js"));
const css = outputs.find((p) => p.endsWith(".css"));
const index = `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gpuplane console</title>
<link rel="stylesheet" href="/ui/${css}">
<script type="module" src="/ui/${js}"></script>
</head>
<body>
<a class="skip" href="#main">Skip to content</a>
<div id="app" data-testid="app"><noscript>The gpuplane console needs JavaScript; the API is under /v1 (see /v1/openapi.json).</noscript></div>
</body>
</html>
`;
writeFileSync(join(dist, "index.html"), index);

const sizes = {};
for (const p of [...outputs, "index.html"]) {
  const b = readFileSync(join(dist, p));
  sizes[p] = { bytes: b.length, gzip: gzipSync(b, { level: 9 }).length };
}
const manifest = { sourceHash: sourceHash(), sources: sources(), js, css, sizes };
writeFileSync(join(dist, "manifest.json"), JSON.stringify(manifest, null, 2) + "\n");
const total = Object.values(sizes).reduce((a, s) => a + s.gzip, 0);
console.log(`console: ${outputs.length + 1} files, ${total} bytes gzipped`, sizes);
