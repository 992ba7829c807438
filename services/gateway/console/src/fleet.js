// Fleet: pools → machines → GPUs, live over GET /v1/fleet/events. Each
// machine is one keyed card: an event for a node rebuilds that card only
// (and only when something it shows changed), never the page, so the page
// keeps up with thousands of machines.
import { h, replace, field, badge, ago, fmtTime, mib, safeId } from "./dom.js";
import { get, tryGet, stream, api, enc } from "./api.js";
import { ctx } from "./main.js";
import { sparkline } from "./charts.js";
import {
  nodeId, gpusOf, ownersOf, sampleOf, utilOf, adminOf, holdOf, healthyOf, gpuState, spotNotice, nodeState, poolStats,
} from "./fleetdata.js";

// LARGE is the fleet size from which cards off the screen are not drawn
// (app.css, .pools.large).
const LARGE = 300;

const STATES = ["free", "busy", "unhealthy", "cordoned", "draining", "spot", "lost"];

// readFleet follows the fleet: onSnapshot(nodes) then onNode(node) per
// change (a node {nodeId, removed: true} is gone). Without the stream it
// falls back to GET /v1/nodes every 10 s and says so through onMode.
function readFleet({ signal, onSnapshot, onNode, onRemove, onMode }) {
  let fallback = null;
  stream("/v1/fleet/events", {
    signal,
    onStatus: (s) => {
      onMode(s);
      if (s === "missing" && !fallback) {
        const poll = async () => {
          try {
            const list = await get("/v1/nodes", { signal });
            onSnapshot(list.nodes || []);
          } catch {}
        };
        poll();
        fallback = setInterval(poll, 10000);
        signal.addEventListener("abort", () => clearInterval(fallback));
      }
    },
    onEvent: (name, data) => {
      if (name === "snapshot") onSnapshot(Array.isArray(data) ? data : data.nodes || []);
      else if (name === "node") {
        const n = data.node || data;
        if (data.removed || data.gone || data.deleted) onRemove(nodeId(n) || data.nodeId);
        else onNode(n);
      }
    },
  });
}

function gpuCell(n, g) {
  const st = gpuState(n, g);
  const owners = ownersOf(g);
  const s = sampleOf(g);
  const util = utilOf(g);
  const hold = holdOf(n, g);
  const mig = g.migInstances || [];
  const health = [];
  // g.health is the last health fact (fleet stream); a sample may carry
  // XID and ECC counters (GET /v1/nodes has neither).
  const hf = g.health;
  if (hf && (!hf.healthy || hf.code)) {
    const kinds = { xid: "XID", ecc_dbe: "ECC double-bit", thermal: "too hot", fell_off_bus: "fell off the bus", recovered: "recovered" };
    const kind = kinds[hf.kind] || hf.kind || "";
    const what = hf.code ? `XID ${hf.code}${hf.kind && hf.kind !== "xid" ? " · " + kind : ""}` : kind;
    health.push(h("span.warn", { title: hf.message || what, testid: "gpu-health" }, (hf.healthy ? "" : "✗ ") + what));
  }
  if (s.lastXid) health.push(h("span.warn", { title: "last XID error" }, "XID " + s.lastXid));
  if (s.eccDbe) health.push(h("span.warn", { title: "double-bit ECC errors" }, "ECC " + s.eccDbe));
  if (s.tempC) health.push(h("span", { title: "temperature" }, Math.round(s.tempC) + "°C"));
  if (s.fbUsedMiB) health.push(h("span", { title: "memory used" }, mib(s.fbUsedMiB)));
  const ownerText = owners.map((o) => (o.hidden ? "another tenant" : `${o.tenant}/${o.jobId}`)).join(", ");
  return h(
    "li.gpu.g-" + st,
    {
      testid: "gpu-" + safeId(g.uuid),
      "data-state": st,
      "data-owner": ownerText || null,
      title: `GPU ${g.index} ${g.model} ${g.uuid}: ${st}${ownerText ? " — " + ownerText : ""}${hold?.reason ? " — " + hold.reason : ""}`,
    },
    h("div.gpu-head", h("span.gpu-idx", "#" + g.index), badge(st)),
    h("div.gpu-model", g.model, g.memoryMiB ? " · " + mib(g.memoryMiB) : ""),
    util != null
      ? h("div.util", h("meter", { min: 0, max: 100, value: util, "aria-label": "utilisation" }), h("span", Math.round(util) + "%"))
      : null,
    health.length ? h("div.health", health) : null,
    hold?.reason ? h("div.hold", "⛔ " + hold.reason) : null,
    owners.length && !mig.length
      ? h(
          "ul.owners",
          owners.map((o) =>
            h(
              "li",
              o.hidden ? "another tenant" : h("a", { href: `/ui/jobs/${enc(o.tenant)}/${enc(o.jobId)}` }, o.tenant + "/" + o.jobId),
              o.share ? ` (share ${o.share.computePercent ?? "?"}% · ${mib(o.share.memoryMiB)})` : "",
            ),
          ),
        )
      : null,
    mig.length
      ? h(
          "ul.mig",
          { "aria-label": "MIG slices" },
          mig.map((m) => {
            const o = owners.find((x) => x.mig && (x.mig === m.uuid || x.mig.uuid === m.uuid));
            return h(
              "li",
              { "data-state": o ? "busy" : "free", testid: "mig-" + safeId(m.uuid || m.profile + "-" + m.start) },
              (o ? "● " : "○ ") + m.profile,
              o ? [" ", o.hidden ? "another tenant" : h("a", { href: `/ui/jobs/${enc(o.tenant)}/${enc(o.jobId)}` }, o.tenant + "/" + o.jobId)] : " free",
            );
          }),
        )
      : null,
  );
}

function nodeCard(n) {
  const id = nodeId(n);
  const a = adminOf(n);
  const st = nodeState(n);
  const deadline = spotNotice(n);
  const holds = [];
  if (a.cordoned) holds.push(badge("cordoned", "cordoned" + (a.reason ? ": " + a.reason : "")));
  if (a.drain) holds.push(badge("draining", "draining" + (a.cause ? " (" + a.cause + ")" : "")));
  if (deadline) holds.push(h("span", { title: fmtTime(deadline) }, badge("spot", "spot notice, reclaimed " + ago(deadline))));
  return h(
    "article.node.n-" + st,
    { testid: "node-" + safeId(id), "data-state": st, "data-pool": n.pool },
    h(
      "header",
      h("a.node-name", { href: "/ui/fleet/nodes/" + enc(id) }, id),
      h("span.meta", [n.machineType, n.priceClass, n.zone].filter(Boolean).join(" · ")),
      badge(st),
      holds,
    ),
    h("ul.gpus", gpusOf(n).map((g) => gpuCell(n, g))),
  );
}

// signature is what a card shows; an event that changes none of it leaves
// the card alone.
const signature = (n) => JSON.stringify(n, (k, v) => (k === "time" || k === "updatedAt" ? undefined : v));

export async function fleetPage(main, { query, signal }) {
  const nodes = new Map(); // id → {n, el, sig}
  const pools = new Map(); // pool → {section, list, stats}
  const filt = { pool: query.get("pool") || "", model: query.get("model") || "", state: query.get("state") || "", q: query.get("q") || "" };
  const mode = h("span.mode", { testid: "fleet-live", role: "status" }, "connecting…");
  const summary = h("tbody");
  const poolSel = h("select", { testid: "filter-pool" }, h("option", { value: "" }, "all pools"));
  const modelSel = h("select", { testid: "filter-model" }, h("option", { value: "" }, "all models"));
  const stateSel = h(
    "select",
    { testid: "filter-state" },
    h("option", { value: "" }, "any state"),
    STATES.map((s) => h("option", { value: s, selected: s === filt.state }, s)),
  );
  const search = h("input", { type: "search", testid: "filter-node", value: filt.q, placeholder: "machine or job" });
  const body = h("div.pools", { testid: "fleet-pools" });
  const count = h("p.count", { role: "status", "aria-live": "polite" });
  replace(
    main,
    h("div.page-head", h("h1", "Fleet"), mode),
    h(
      "section",
      { "aria-label": "Pools" },
      h(
        "table.summary",
        { testid: "pool-summary" },
        h("caption", "Allocation and fragmentation per pool"),
        h(
          "thead",
          h(
            "tr",
            ["Pool", "Machines", "GPUs", "Allocated", "Free", "Unhealthy", "Held", "Allocation", "Fragmentation"].map((c) =>
              h("th", { scope: "col" }, c),
            ),
          ),
        ),
        summary,
      ),
    ),
    h(
      "form.filters",
      { role: "search", onsubmit: (e) => e.preventDefault() },
      field("Pool", poolSel),
      field("Model", modelSel),
      field("State", stateSel),
      field("Search", search),
    ),
    count,
    body,
  );

  const matches = (n) => {
    if (filt.pool && n.pool !== filt.pool) return false;
    const gs = gpusOf(n);
    if (filt.model && !gs.some((g) => g.model === filt.model)) return false;
    if (filt.state) {
      const st = nodeState(n);
      if (st !== filt.state && !gs.some((g) => gpuState(n, g) === filt.state)) return false;
    }
    if (filt.q) {
      const q = filt.q.toLowerCase();
      const hay = nodeId(n) + " " + (n.hostname || "") + " " + gs.flatMap((g) => ownersOf(g).map((o) => o.tenant + "/" + o.jobId)).join(" ");
      if (!hay.toLowerCase().includes(q)) return false;
    }
    return true;
  };

  const options = (sel, values, chosen) => {
    const have = new Set([...sel.options].map((o) => o.value));
    for (const v of [...values].sort()) if (!have.has(v)) sel.append(h("option", { value: v, selected: v === chosen }, v));
  };

  let dirty = false;
  const refreshSummary = () => {
    if (dirty) return;
    dirty = true;
    requestAnimationFrame(() => {
      dirty = false;
      const byPool = new Map();
      const models = new Set();
      let shown = 0;
      for (const { n, el } of nodes.values()) {
        if (!byPool.has(n.pool)) byPool.set(n.pool, []);
        byPool.get(n.pool).push(n);
        for (const g of gpusOf(n)) models.add(g.model);
        if (!el.hidden) shown++;
      }
      options(poolSel, byPool.keys(), filt.pool);
      options(modelSel, models, filt.model);
      replace(
        summary,
        [...byPool.keys()].sort().map((p) => {
          const s = poolStats(byPool.get(p));
          return h(
            "tr",
            { testid: "pool-row-" + safeId(p) },
            h("th", { scope: "row" }, h("a", { href: "/ui/fleet?pool=" + enc(p) }, p)),
            h("td", s.machines),
            h("td", s.total),
            h("td", s.used),
            h("td", s.free),
            h("td", s.unhealthy ? "✗ " + s.unhealthy : "0"),
            h("td", s.held),
            h("td", { testid: "alloc-" + safeId(p) }, h("meter", { min: 0, max: 1, value: s.allocation, "aria-hidden": "true" }), " ", Math.round(s.allocation * 100) + "%"),
            h("td", { testid: "frag-" + safeId(p) }, Math.round(s.fragmentation * 100) + "%"),
          );
        }),
      );
      count.textContent = `${shown} of ${nodes.size} machines shown`;
    });
  };

  const poolOf = (name) => {
    let p = pools.get(name);
    if (!p) {
      const list = h("div.nodes");
      const section = h("section.pool", { testid: "pool-" + safeId(name), "aria-label": "Pool " + name }, h("h2", "Pool ", name), list);
      // Pools in name order.
      const after = [...pools.keys()].sort().find((k) => k > name);
      body.insertBefore(section, after ? pools.get(after).section : null);
      p = { section, list };
      pools.set(name, p);
    }
    return p;
  };

  const put = (n) => {
    const id = nodeId(n);
    if (!id) return;
    const sig = signature(n);
    const prev = nodes.get(id);
    if (prev && prev.sig === sig) return;
    const el = nodeCard(n);
    el.hidden = !matches(n);
    if (prev && prev.n.pool === n.pool) prev.el.replaceWith(el);
    else {
      if (prev) prev.el.remove();
      const list = poolOf(n.pool || "default").list;
      // Cards in ID order; a snapshot comes ordered, so appending is the
      // common case and the scan is for a machine that joins later.
      const last = list.lastElementChild;
      const after = !last || last.dataset.testid < el.dataset.testid ? null : [...list.children].find((c) => c.dataset.testid > el.dataset.testid);
      list.insertBefore(el, after || null);
    }
    nodes.set(id, { n, el, sig });
    refreshSummary();
  };
  const remove = (id) => {
    const prev = nodes.get(id);
    if (prev) prev.el.remove();
    nodes.delete(id);
    refreshSummary();
  };

  const applyFilters = () => {
    const q = new URLSearchParams(location.search);
    for (const [k, v] of Object.entries(filt)) v ? q.set(k, v) : q.delete(k);
    history.replaceState(null, "", location.pathname + (q.toString() ? "?" + q : ""));
    for (const { n, el } of nodes.values()) el.hidden = !matches(n);
    for (const p of pools.values()) p.section.hidden = ![...p.list.children].some((c) => !c.hidden);
    refreshSummary();
  };
  poolSel.onchange = () => ((filt.pool = poolSel.value), applyFilters());
  modelSel.onchange = () => ((filt.model = modelSel.value), applyFilters());
  stateSel.onchange = () => ((filt.state = stateSel.value), applyFilters());
  search.oninput = () => ((filt.q = search.value.trim()), applyFilters());

  let snapshotGen = 0;
  let queued = null; // node events waiting for a snapshot being drawn
  readFleet({
    signal,
    onMode: (s) => {
      mode.textContent =
        s === "live" ? "● live" : s === "missing" ? "↻ every 10 s (no fleet stream on this gateway)" : s === "forbidden" ? "✗ the fleet is an operator's view" : "… " + s;
      mode.dataset.state = s;
    },
    // A snapshot is drawn in slices of 200 machines, a task each, so the
    // first screen paints at once and the page answers input while a
    // large fleet is drawn; node events that come meanwhile wait for it
    // (an older snapshot entry must not overwrite a newer event).
    onSnapshot: (list) => {
      const gen = ++snapshotGen;
      body.classList.toggle("large", list.length > LARGE);
      queued = [];
      const seen = new Set(list.map(nodeId));
      for (const id of [...nodes.keys()]) if (!seen.has(id)) remove(id);
      let i = 0;
      const slice = () => {
        if (gen !== snapshotGen || signal.aborted) return;
        for (const end = Math.min(list.length, i + 200); i < end; i++) put(list[i]);
        if (i < list.length) return void setTimeout(slice, 0);
        applyFilters();
        const later = queued;
        queued = null;
        for (const ev of later) ev();
      };
      slice();
    },
    onNode: (n) => {
      const apply = () => {
        put(n);
        const p = pools.get(n.pool || "default");
        if (p) p.section.hidden = ![...p.list.children].some((c) => !c.hidden);
      };
      if (queued) queued.push(apply);
      else apply();
    },
    onRemove: (id) => (queued ? queued.push(() => remove(id)) : remove(id)),
  });
}

// nodePage is one machine: its GPUs with telemetry sparklines, topology,
// holds, runs, and the operator's actions.
export async function nodePage(main, { params, signal }) {
  const id = params.node;
  let n = await get("/v1/nodes/" + enc(id), { signal });
  // The sparklines start from the machine's last ten minutes of telemetry
  // (GET /v1/nodes/{node}/telemetry); the fleet stream moves them on.
  const history = new Map(); // uuid → [[t, util]]
  const tel = await tryGet(`/v1/nodes/${enc(id)}/telemetry?since=10m&points=120`, { signal }).catch(() => null);
  for (const batch of tel?.samples || []) {
    const t = Date.parse(batch.time) / 1000;
    for (const g of batch.gpus || []) {
      if (g.gpuUtil == null || !isFinite(t)) continue;
      if (!history.has(g.uuid)) history.set(g.uuid, []);
      history.get(g.uuid).push([t, g.gpuUtil]);
    }
  }
  const sparks = new Map();
  const gpuBox = h("div", { testid: "node-gpus" });
  const runs = h("tbody");
  const headBox = h("div");
  const msg = h("p.note", { role: "status", testid: "node-action-result" });

  const draw = () => {
    const a = adminOf(n);
    const deadline = spotNotice(n);
    replace(
      headBox,
      h("div.page-head", h("h1", "Machine ", h("span", { testid: "node-id" }, id)), badge(nodeState(n))),
      h(
        "dl.facts",
        [
          ["Pool", h("a", { href: "/ui/fleet?pool=" + enc(n.pool) }, n.pool)],
          ["Machine type", n.machineType],
          ["Price class", n.priceClass],
          ["Zone", n.zone],
          ["Hostname", n.hostname],
          ["Driver / CUDA", [n.driverVersion, n.cudaVersion].filter(Boolean).join(" / ")],
          ["CPU / memory", n.cpuMilli ? `${n.cpuMilli / 1000} cores · ${mib(n.memoryMiB)}` : ""],
          ["Lifecycle", n.lifecycle ? `${n.lifecycle} ${ago(n.lifecycleAt)}` : ""],
          ["Holds", [a.cordoned ? "cordoned" : "", a.drain ? "draining" : "", a.reason || ""].filter(Boolean).join(", ") || "none"],
          ["Spot notice", deadline ? `reclaimed ${ago(deadline)} (${fmtTime(deadline)})` : "none"],
          ["Labels", Object.entries(n.labels || {}).map(([k, v]) => k + "=" + v).join(", ")],
          ["Taints", (n.taints || []).map((t) => `${t.key}=${t.value || ""}:${t.effect}`).join(", ")],
        ]
          .filter(([, v]) => v)
          .map(([k, v]) => [h("dt", k), h("dd", v)]),
      ),
      n.topology?.length
        ? h(
            "details",
            h("summary", "Topology (", n.topology.length, " links)"),
            h(
              "table",
              h("thead", h("tr", h("th", "GPU"), h("th", "GPU"), h("th", "Path"), h("th", "NVLinks"))),
              h("tbody", n.topology.map((l) => h("tr", h("td", l.a), h("td", l.b), h("td", l.path), h("td", l.nvlinks ?? "")))),
            ),
          )
        : null,
    );
    replace(
      gpuBox,
      h("h2", "GPUs"),
      h(
        "ul.gpus.wide",
        gpusOf(n).map((g) => {
          let sp = sparks.get(g.uuid);
          if (!sp) {
            sp = sparkline(`GPU ${g.index} utilisation`, { testid: "spark-" + safeId(g.uuid) });
            sparks.set(g.uuid, sp);
            for (const [t, v] of history.get(g.uuid) || []) sp.push(v, t);
          }
          sp.push(utilOf(g));
          const cell = gpuCell(n, g);
          cell.append(sp.el);
          if (ctx.isAdmin) {
            const hold = holdOf(n, g);
            cell.append(
              h(
                "div.actions",
                hold
                  ? h("button", { type: "button", onclick: () => act(`/gpus/${enc(g.uuid)}/uncordon`) }, "Uncordon GPU")
                  : [
                      h("button", { type: "button", onclick: () => act(`/gpus/${enc(g.uuid)}/cordon`) }, "Cordon GPU"),
                      h("button", { type: "button", onclick: () => act(`/gpus/${enc(g.uuid)}/drain`) }, "Drain GPU"),
                    ],
              ),
            );
          }
          return cell;
        }),
      ),
    );
    const allOwners = gpusOf(n).flatMap((g) => ownersOf(g).filter((o) => !o.hidden).map((o) => ({ ...o, gpu: g.index })));
    const byJob = new Map();
    for (const o of allOwners) {
      const k = o.tenant + "/" + o.jobId;
      if (!byJob.has(k)) byJob.set(k, { ...o, gpus: [] });
      byJob.get(k).gpus.push(o.gpu);
    }
    replace(
      runs,
      byJob.size
        ? [...byJob.values()].map((o) =>
            h(
              "tr",
              h("td", h("a", { href: `/ui/jobs/${enc(o.tenant)}/${enc(o.jobId)}` }, o.tenant + "/" + o.jobId)),
              h("td", o.allocationId),
              h("td", o.gpus.map((i) => "#" + i).join(", ")),
            ),
          )
        : h("tr", h("td", { colspan: 3 }, "No runs on this machine (or the gateway does not send owners yet).")),
    );
  };

  const reason = h("input", { name: "reason", testid: "node-reason", placeholder: "why (kept in the audit log)" });
  const act = async (suffix) => {
    msg.textContent = "…";
    try {
      await api("POST", "/v1/nodes/" + enc(id) + suffix, { reason: reason.value || "from the console" });
      msg.textContent = "✓ done; the change shows as the fleet reports it";
      n = await get("/v1/nodes/" + enc(id), { signal });
      draw();
    } catch (e) {
      msg.textContent = "✗ " + e.message;
    }
  };
  replace(
    main,
    h("p", h("a", { href: "/ui/fleet" }, "← Fleet")),
    headBox,
    ctx.isAdmin
      ? h(
          "section.card",
          { testid: "node-actions", "aria-label": "Machine actions" },
          h("h2", "Actions"),
          field("Reason", reason),
          h(
            "div.actions",
            h("button", { type: "button", testid: "node-cordon", onclick: () => act("/cordon") }, "Cordon"),
            h("button", { type: "button", testid: "node-drain", onclick: () => act("/drain") }, "Drain"),
            h("button", { type: "button", testid: "node-uncordon", onclick: () => act("/uncordon") }, "Uncordon"),
          ),
          msg,
        )
      : null,
    gpuBox,
    h(
      "section",
      h("h2", "Runs"),
      h("table", { testid: "node-runs" }, h("thead", h("tr", h("th", "Job"), h("th", "Allocation"), h("th", "GPUs"))), runs),
    ),
  );
  draw();
  stream("/v1/fleet/events", {
    signal,
    onStatus: () => {},
    onEvent: (name, data) => {
      const list = name === "snapshot" ? (Array.isArray(data) ? data : data.nodes || []) : [data.node || data];
      const mine = list.find((x) => nodeId(x) === id);
      if (mine) {
        n = { ...n, ...mine };
        draw();
      }
    },
  });
}
