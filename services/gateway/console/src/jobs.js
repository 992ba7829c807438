// Jobs: the tenant's list (live over the tenant's event stream, one keyed
// row per job), a job's page (timeline, placements per gang rank,
// why-pending, live logs per rank and attempt, actions) and the submit
// form, whose field errors are the API's own, shown once next to the field.
import { h, replace, field, badge, ago, fmtTime, mib, safeId } from "./dom.js";
import { api, get, stream, follow, enc, ApiError } from "./api.js";
import { ctx, navigate } from "./main.js";

const TERMINAL = new Set(["succeeded", "failed", "cancelled", "rejected"]);

// cancellable: a job that has not ended may be cancelled (queued,
// scheduled, running, and whatever new state the API adds before its end).
export const cancellable = (state) => !!state && !TERMINAL.has(state);
// checkpointable: only a running job that asked for checkpoints
// (run.checkpoint) can write one now (the gateway answers 409 otherwise).
export const checkpointable = (d) => d.state === "running" && !!d.request?.run?.checkpoint;
const PAGE = 500;

function gpuText(req) {
  const g = req?.resources?.gpu;
  if (!g) return "";
  let s = `${g.count ?? 1}× ${g.model || (g.models || []).join("|") || "any"}`;
  if (g.nodes > 1) s += ` on ${g.nodes} machines`;
  if (g.migProfile) s += ` ${g.migProfile}`;
  if (g.share) s += ` share ${g.share.computePercent ?? ""}%`;
  return s;
}

function why(j) {
  return [j.reason, j.message].filter(Boolean).join(": ");
}

function jobRow(j) {
  const t = j.tenant, id = j.jobId;
  const reason = why(j);
  return h(
    "tr",
    { testid: "job-row-" + safeId(id), "data-state": j.state },
    h("td.c-id", h("a", { href: `/ui/jobs/${enc(t)}/${enc(id)}`, title: id }, id), j.name ? h("div.sub", { title: j.name }, j.name) : null),
    h("td.c-state", { testid: "job-state-" + safeId(id) }, badge(j.state)),
    h("td.c-gpus", { title: gpuText(j.request) }, gpuText(j.request)),
    h("td.c-pool", j.placement?.pool || j.request?.pool || ""),
    h("td.c-prio", j.request?.priority || "normal"),
    h("td.c-time", { title: fmtTime(j.updatedAt) }, ago(j.updatedAt || j.createdAt)),
    h("td.c-why", h("div.clip", { title: reason }, reason)),
  );
}

export async function jobsPage(main, { query, signal }) {
  const tenant = ctx.tenant;
  if (!tenant) {
    replace(main, h("h1", "Jobs"), h("p", "You have no tenant yet: ask an administrator to bind you a role on one."));
    return;
  }
  const rows = new Map(); // id → {j, el}
  const tbody = h("tbody");
  const search = h("input", { type: "search", testid: "jobs-search", value: query.get("q") || "", placeholder: "ID, name, state, reason" });
  const stateSel = h(
    "select",
    { testid: "jobs-state" },
    h("option", { value: "" }, "any state"),
    ["queued", "scheduled", "running", "succeeded", "failed", "cancelled", "rejected"].map((s) =>
      h("option", { value: s, selected: s === query.get("state") }, s),
    ),
  );
  const mode = h("span.mode", { testid: "jobs-live", role: "status" }, "connecting…");
  const count = h("p.count", { role: "status", "aria-live": "polite" });
  const more = h("button", { type: "button", hidden: true, testid: "jobs-more" }, "Load more");
  replace(
    main,
    h("div.page-head", h("h1", "Jobs of ", h("span", { testid: "jobs-tenant" }, tenant)), mode,
      h("a.button", { href: "/ui/jobs/new?tenant=" + enc(tenant), testid: "new-job" }, "+ Submit a job")),
    h("form.filters", { role: "search", onsubmit: (e) => e.preventDefault() }, field("Search", search), field("State", stateSel)),
    count,
    h(
      "table.jobs",
      { testid: "jobs-table" },
      h("caption.sr", "Jobs"),
      h(
        "thead",
        h("tr", ["Job", "State", "GPUs", "Pool", "Priority", "Updated", "Why"].map((c, i) =>
          h("th", { scope: "col", class: ["c-id", "c-state", "c-gpus", "c-pool", "c-prio", "c-time", "c-why"][i] }, c))),
      ),
      tbody,
    ),
    more,
  );
  const matches = (j) => {
    if (stateSel.value && j.state !== stateSel.value) return false;
    const q = search.value.trim().toLowerCase();
    if (!q) return true;
    return [j.jobId, j.name, j.state, j.reason, j.message, j.request?.pool, gpuText(j.request)].join(" ").toLowerCase().includes(q);
  };
  const recount = () => {
    let shown = 0;
    for (const r of rows.values()) if (!r.el.hidden) shown++;
    count.textContent = `${shown} of ${rows.size} jobs shown`;
  };
  const filter = () => {
    const q = new URLSearchParams(location.search);
    search.value.trim() ? q.set("q", search.value.trim()) : q.delete("q");
    stateSel.value ? q.set("state", stateSel.value) : q.delete("state");
    history.replaceState(null, "", location.pathname + (q.toString() ? "?" + q : ""));
    for (const r of rows.values()) r.el.hidden = !matches(r.j);
    recount();
  };
  search.oninput = filter;
  // The state is asked of the gateway (?state=), so a tenant with more
  // jobs than a page still finds every job in that state.
  stateSel.onchange = async () => {
    filter();
    rows.clear();
    tbody.replaceChildren();
    after = "";
    await load().catch((e) => (count.textContent = "✗ " + e.message));
  };

  // put places a job's row: newest first, replaced in place on change.
  const put = (j, atTop) => {
    const el = jobRow(j);
    el.hidden = !matches(j);
    const prev = rows.get(j.jobId);
    if (prev) prev.el.replaceWith(el);
    else if (atTop) tbody.prepend(el);
    else tbody.append(el);
    rows.set(j.jobId, { j, el });
  };
  let after = "";
  let lastSeq = 0;
  // A page asks for one job more than it shows: that job's presence is
  // the API saying a next page exists, so a tenant whose jobs fill the
  // page exactly is not offered "Load more" (5 of 5 shown, and a button
  // that loads nothing). ?limit= sets the page size (1 to 999).
  const size = Math.min(999, Math.max(1, Number(query.get("limit")) || PAGE));
  const load = async () => {
    const q = new URLSearchParams({ limit: String(size + 1) });
    if (after) q.set("after", after);
    if (stateSel.value) q.set("state", stateSel.value);
    const list = await get(`/v1/tenants/${enc(tenant)}/jobs?${q}`, { signal });
    const all = list.jobs || [];
    const jobs = all.slice(0, size);
    for (const j of jobs) {
      put(j, false);
      lastSeq = Math.max(lastSeq, j.lastSeq || 0);
    }
    after = all.length > size ? jobs[jobs.length - 1].jobId : "";
    more.hidden = !after;
    recount();
  };
  more.onclick = load;
  await load();
  // Refresh a job's row from the read model once per burst of events.
  const pending = new Map();
  const refresh = (id) => {
    if (pending.has(id)) return;
    pending.set(
      id,
      setTimeout(async () => {
        pending.delete(id);
        try {
          put(await get(`/v1/tenants/${enc(tenant)}/jobs/${enc(id)}`, { signal }), !rows.has(id));
          recount();
        } catch {}
      }, 250),
    );
  };
  signal.addEventListener("abort", () => pending.forEach((t) => clearTimeout(t)));
  stream(`/v1/tenants/${enc(tenant)}/events`, {
    signal,
    after: String(lastSeq),
    onStatus: (s) => ((mode.textContent = s === "live" ? "● live" : "… " + s), (mode.dataset.state = s)),
    onEvent: (name, ev) => {
      if (ev && ev.jobId) refresh(ev.jobId);
    },
  });
}

// rankOf reads a gang rank from an allocation ID: tenant/job/attempt for
// one machine, tenant/job/attempt/rank for a gang's.
function rankOf(p, i) {
  const parts = (p.allocationId || "").split("/");
  return parts.length >= 4 && /^\d+$/.test(parts[3]) ? Number(parts[3]) : i;
}

// knownWithin is how long the job page waits for a job it does not know
// yet: the submit form opens the page on the submit's 202, and the job
// appears once the scheduler has queued or rejected it, a few
// milliseconds later, seconds on a loaded platform.
const knownWithin = 60_000;

// describeOnceKnown reads a job's description; while the gateway answers
// unknown_job it says so on the page and asks again every half second,
// for knownWithin, then shows the error as it is.
async function describeOnceKnown(main, path, signal) {
  const until = Date.now() + knownWithin;
  for (;;) {
    try {
      return await get(path, { signal });
    } catch (e) {
      if (!(e instanceof ApiError) || e.status !== 404 || e.reason !== "unknown_job" || Date.now() > until) throw e;
      replace(main, h("p.note", { role: "status", testid: "job-waiting" }, e.message, "; asking again…"));
      await new Promise((resolve, reject) => {
        const t = setTimeout(resolve, 500);
        signal?.addEventListener("abort", () => (clearTimeout(t), reject(signal.reason)), { once: true });
      });
    }
  }
}

export async function jobPage(main, { params, signal }) {
  const { tenant, id } = params;
  const base = `/v1/tenants/${enc(tenant)}/jobs/${enc(id)}`;
  let d = await describeOnceKnown(main, base + "/describe", signal);
  const head = h("div");
  const pendingBox = h("section", { testid: "job-pending", "aria-live": "polite" });
  const placements = h("section", { testid: "job-placements" });
  const timeline = h("ol.timeline", { testid: "job-timeline" });
  const actionMsg = h("p.note", { role: "status", testid: "job-action-result" });
  const seen = new Set();
  // Checkpoints: what the job's events say of them (asked for, written
  // before a move, restored from), newest last.
  const checkpoints = h("ul", { testid: "job-checkpoints" });
  const noCheckpoint = h("p.note", "None written or restored yet.");

  const addEvent = (e) => {
    const key = e.seq || `${e.type}-${e.time}`;
    if (seen.has(key)) return;
    seen.add(key);
    const said = [e.reason, e.message].filter(Boolean).join(": ");
    if (/checkpoint/i.test(said) || e.migration?.checkpointed || e.migration?.restoredFrom) {
      noCheckpoint.hidden = true;
      checkpoints.append(
        h("li", { testid: "checkpoint" }, h("time", { datetime: e.time }, fmtTime(e.time)), " ", e.type, ": ",
          e.migration?.restoredFrom ? `restored from ${e.migration.restoredFrom}; ` : "", said),
      );
    }
    timeline.append(
      h(
        "li",
        { testid: "timeline-event", "data-type": e.type },
        h("time", { datetime: e.time, title: fmtTime(e.time) }, fmtTime(e.time)),
        " ",
        badge(e.type),
        e.attempt ? h("span.sub", " attempt " + e.attempt) : null,
        e.reason || e.message ? h("div.why", [e.reason, e.message].filter(Boolean).join(": ")) : null,
      ),
    );
  };

  // The actions offered are those the job's state allows (the gateway
  // refuses the others): cancel until it ends, a checkpoint while a job
  // that writes them runs. Redrawn with the state.
  const canAct = ctx.can("member", tenant);
  const cancelBtn = h("button", { type: "button", testid: "job-cancel", onclick: () => confirm(`Cancel ${id}?`) && act("cancel") }, "Cancel");
  const checkpointBtn = h("button", { type: "button", testid: "job-checkpoint", onclick: () => act("checkpoint") }, "Checkpoint now");
  const syncActions = () => {
    cancelBtn.hidden = !canAct || !cancellable(d.state);
    checkpointBtn.hidden = !canAct || !checkpointable(d);
  };
  const draw = () => {
    syncActions();
    const req = d.request || {};
    const g = req.resources?.gpu || {};
    replace(
      head,
      h("div.page-head", h("h1", "Job ", h("span", { testid: "job-id" }, id)), h("span", { testid: "job-state", "data-state": d.state }, badge(d.state))),
      h(
        "dl.facts",
        [
          ["Tenant", tenant],
          ["Name", d.name],
          ["GPUs", gpuText(req)],
          ["Topology", g.topology],
          ["Pool", req.pool],
          ["Priority", req.priority],
          ["Image", req.run?.image],
          ["Command", [...(req.run?.command || []), ...(req.run?.args || [])].join(" ")],
          ["Depends on", (d.dependsOn || req.dependsOn || []).map((x) => h("a", { href: `/ui/jobs/${enc(tenant)}/${enc(x)}` }, x + " "))],
          ["Expected run time", req.expectedRunTime],
          ["Attempt", d.attempt],
          ["Created", fmtTime(d.createdAt)],
          ["Started", fmtTime(d.startedAt)],
          ["Ended", d.endedAt ? fmtTime(d.endedAt) + (d.exitCode != null ? ", exit code " + d.exitCode : "") : ""],
          ["Checkpoints", req.run?.checkpoint ? "written on request (SIGUSR1) and before a move" : ""],
        ]
          .filter(([, v]) => v != null && v !== "" && !(Array.isArray(v) && !v.length))
          .map(([k, v]) => [h("dt", k), h("dd", v)]),
      ),
      d.errors?.length ? h("ul.error", d.errors.map((e) => h("li", `${e.field}: ${e.message}`))) : null,
    );
    const p = d.pending;
    replace(
      pendingBox,
      !TERMINAL.has(d.state) && (p?.reason || d.state === "pending" || d.state === "queued")
        ? [h("h2", "Why it waits"), h("p.why", { testid: "job-why-pending" }, p ? [p.reason, p.message].filter(Boolean).join(": ") + (p.since ? ` (since ${ago(p.since)})` : "") : why(d) || "waiting for the scheduler")]
        : d.reason && TERMINAL.has(d.state)
          ? [h("h2", "Outcome"), h("p.why", why(d))]
          : null,
    );
    const ps = d.placements || [];
    replace(
      placements,
      h("h2", "Placements"),
      ps.length
        ? h(
            "table",
            h("thead", h("tr", h("th", "Rank"), h("th", "Machine"), h("th", "Pool"), h("th", "GPUs"))),
            h(
              "tbody",
              ps.map((pl, i) =>
                h(
                  "tr",
                  { testid: "placement-" + rankOf(pl, i) },
                  h("td", rankOf(pl, i)),
                  h("td", h("a", { href: "/ui/fleet/nodes/" + enc(pl.nodeId) }, pl.nodeId)),
                  h("td", pl.pool),
                  h("td", (pl.devices || []).map((dv) => `#${dv.index} ${dv.model || ""}${dv.mig ? " " + dv.mig.profile : ""}${dv.share ? " share" : ""}`).join(", ")),
                ),
              ),
            ),
          )
        : h("p", "Not placed."),
    );
  };

  // Logs: one rank and attempt at a time, followed live while it runs.
  const rankSel = h("select", { testid: "logs-rank" });
  const attemptSel = h("select", { testid: "logs-attempt" });
  const followBox = h("input", { type: "checkbox", checked: true, testid: "logs-follow" });
  const logs = h("pre.logs", { testid: "job-logs", tabindex: "0", "aria-label": "Logs", "aria-live": "off" });
  let logCtl = null;
  const options = () => {
    const ranks = Math.max(1, (d.placements || []).length, d.request?.resources?.gpu?.nodes || 1);
    const r = rankSel.value, a = attemptSel.value;
    replace(rankSel, Array.from({ length: ranks }, (_, i) => h("option", { value: i, selected: String(i) === r }, "rank " + i)));
    replace(attemptSel, h("option", { value: "latest" }, "latest"),
      Array.from({ length: d.attempt || 0 }, (_, i) => h("option", { value: i + 1, selected: String(i + 1) === a }, "attempt " + (i + 1))));
    if (a) attemptSel.value = a;
  };
  const readLogs = async () => {
    if (logCtl) logCtl.abort();
    logCtl = new AbortController();
    const sig = logCtl.signal;
    signal.addEventListener("abort", () => logCtl.abort());
    logs.textContent = "";
    const q = new URLSearchParams({ rank: rankSel.value || "0", attempt: attemptSel.value || "latest" });
    if (followBox.checked && !TERMINAL.has(d.state)) q.set("follow", "true");
    try {
      await follow(`${base}/logs?${q}`, (t) => {
        const atEnd = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 8;
        logs.append(t);
        if (atEnd) logs.scrollTop = logs.scrollHeight;
      }, sig);
    } catch (e) {
      if (!sig.aborted) logs.append(h("span.note", e instanceof ApiError && e.status === 404 ? "(no output yet)" : "(" + e.message + ")"));
    }
  };
  rankSel.onchange = attemptSel.onchange = followBox.onchange = readLogs;

  const act = async (what) => {
    actionMsg.textContent = "…";
    try {
      if (what === "cancel") await api("DELETE", base);
      else if (what === "checkpoint") await api("POST", base + "/checkpoint", {});
      actionMsg.textContent = "✓ " + what + " requested";
    } catch (e) {
      actionMsg.textContent = "✗ " + e.message;
    }
  };
  replace(
    main,
    h("p", h("a", { href: "/ui/jobs?tenant=" + enc(tenant) }, "← Jobs of " + tenant)),
    head,
    h(
      "div.actions",
      { testid: "job-actions" },
      cancelBtn,
      checkpointBtn,
      canAct ? h("a.button", { href: `/ui/jobs/new?tenant=${enc(tenant)}&from=${enc(id)}`, testid: "job-resubmit" }, "Resubmit as new") : null,
    ),
    actionMsg,
    pendingBox,
    placements,
    h("section", h("h2", "Timeline"), timeline),
    h("section", h("h2", "Checkpoints"), noCheckpoint, checkpoints),
    h("section", h("h2", "Logs"), h("div.filters", field("Rank", rankSel), field("Attempt", attemptSel), field("Follow", followBox)), logs),
  );
  draw();
  for (const e of d.events || []) addEvent(e);
  options();
  readLogs();

  // Live: the job's event stream, after the last event described.
  let wasTerminal = TERMINAL.has(d.state);
  let lastAttempt = d.attempt;
  let redescribe = null;
  stream(base + "/events", {
    signal,
    ends: true,
    after: String(Math.max(0, ...(d.events || []).map((e) => e.seq || 0))),
    onStatus: () => {},
    onEvent: (name, ev, id) => {
      addEvent({ ...ev, type: ev.type || name, seq: Number(id) || undefined });
      // The state shows at once; the rest follows from describe.
      if (ev.state && ev.state !== d.state) {
        d = { ...d, state: ev.state };
        draw();
      }
      clearTimeout(redescribe);
      redescribe = setTimeout(async () => {
        try {
          d = await get(base + "/describe", { signal });
          draw();
          options();
          // A new attempt, or the end, changes what the logs follow.
          if (d.attempt !== lastAttempt || (!wasTerminal && TERMINAL.has(d.state))) {
            lastAttempt = d.attempt;
            wasTerminal = TERMINAL.has(d.state);
            if (followBox.checked) readLogs();
          }
        } catch {}
      }, 200);
    },
  });
}

// ---- submit form ----------------------------------------------------

let schemaEnums = null;
async function enums() {
  if (schemaEnums) return schemaEnums;
  try {
    const doc = await get("/v1/openapi.json");
    const s = doc.components.schemas;
    schemaEnums = {
      models: s.GPURequest.properties.model.enum,
      priorities: s.JobRequest.properties.priority.enum,
      topologies: s.GPURequest.properties.topology.enum,
      effects: s.Toleration.properties.effect.enum,
    };
  } catch {
    schemaEnums = { models: ["any"], priorities: ["critical", "high", "normal", "best-effort"], topologies: ["", "nvlink", "zone"], effects: ["", "NoSchedule", "PreferNoSchedule"] };
  }
  return schemaEnums;
}

// words splits a command line as a shell would for simple quoting.
export function words(s) {
  const out = [];
  const re = /"((?:[^"\\]|\\.)*)"|'([^']*)'|(\S+)/g;
  let m;
  while ((m = re.exec(s))) out.push(m[1] != null ? m[1].replace(/\\(.)/g, "$1") : m[2] != null ? m[2] : m[3]);
  return out;
}

const pairs = (text) =>
  Object.fromEntries(
    text
      .split(/\n|,/)
      .map((l) => l.trim())
      .filter(Boolean)
      .map((l) => {
        const i = l.indexOf("=");
        return i < 0 ? [l, ""] : [l.slice(0, i).trim(), l.slice(i + 1).trim()];
      }),
  );

// toleration lines: key=value:Effect, key:Exists:Effect or key:Exists.
function tolerations(text) {
  return text
    .split("\n")
    .map((l) => l.trim())
    .filter(Boolean)
    .map((l) => {
      const [kv, a, b] = l.split(":");
      if (a === "Exists") return { key: kv, operator: "Exists", ...(b ? { effect: b } : {}) };
      const [key, value = ""] = kv.split("=");
      return { key, operator: "Equal", value, ...(a ? { effect: a } : {}) };
    });
}

export async function submitPage(main, { query, signal }) {
  const e = await enums();
  const tenant = ctx.tenant;
  let from = null;
  if (query.get("from")) from = (await get(`/v1/tenants/${enc(tenant)}/jobs/${enc(query.get("from"))}`, { signal }).catch(() => null))?.request;
  const fr = from || {};
  const g = fr.resources?.gpu || {};
  const run = fr.run || {};
  const inputs = [];
  // inp makes an input for an API field path; its error shows beside it.
  const inp = (path, label, el, hint) => {
    el.name = el.name || path;
    el.dataset.field = path;
    el.setAttribute("data-testid", "field-" + path);
    const err = h("div.field-error", { id: "err-" + safeId(path), testid: "field-error-" + path, role: "alert", hidden: true });
    el.setAttribute("aria-describedby", err.id);
    inputs.push({ path, el, err });
    const f = field(label, el, hint);
    f.append(err);
    return f;
  };
  const text = (v, attrs = {}) => h("input", { value: v ?? "", ...attrs });
  const num = (v, attrs = {}) => h("input", { type: "number", inputmode: "numeric", value: v ?? "", ...attrs });
  const sel = (vals, v, labels = {}) => h("select", vals.map((x) => h("option", { value: x, selected: x === (v ?? "") }, labels[x] || x || "none")));
  const area = (v, attrs = {}) => h("textarea", { rows: 2, ...attrs }, v ?? "");
  const kv = (o) => Object.entries(o || {}).map(([k, v]) => k + "=" + v).join("\n");

  const general = h("div.error", { role: "alert", testid: "submit-error", hidden: true });
  const result = h("p.note", { role: "status", testid: "submit-result" });
  const durationDefault = run.duration || "30s";
  const form = h(
    "form.submit",
    { testid: "submit-form", novalidate: true, "aria-label": "Submit a job" },
    h("h1", "Submit a job to ", tenant),
    general,
    h(
      "fieldset",
      h("legend", "Job"),
      inp("id", "ID (optional)", text("", { placeholder: "generated when empty", autocomplete: "off" })),
      inp("name", "Name", text(fr.name)),
      inp("pool", "Pool", text(fr.pool, { placeholder: "any pool" })),
      inp("priority", "Priority", sel(e.priorities, fr.priority || "normal")),
      inp("dependsOn", "Depends on", text((fr.dependsOn || []).join(" "), { placeholder: "job IDs, space separated" }), "starts after these succeed"),
      inp("expectedRunTime", "Expected run time", text(fr.expectedRunTime, { placeholder: "e.g. 2h (helps backfill)" })),
      inp("placementTimeout", "Placement timeout", text(fr.placementTimeout, { placeholder: "e.g. 10m" })),
    ),
    h(
      "fieldset",
      h("legend", "GPUs"),
      inp("resources.gpu.count", "GPUs per machine", num(g.count ?? 1, { min: 0, max: 64 })),
      inp("resources.gpu.model", "Model", sel(e.models, g.model || "any")),
      inp("resources.gpu.memoryMiB", "GPU memory at least (MiB)", num(g.memoryMiB, { min: 0 })),
      inp("resources.gpu.nodes", "Machines (gang size)", num(g.nodes ?? 1, { min: 1, max: 128 }), "a gang: all machines start together"),
      inp("resources.gpu.topology", "Topology", sel(e.topologies, g.topology || "", { "": "no constraint" })),
      inp("resources.gpu.migProfile", "MIG profile", text(g.migProfile, { placeholder: "e.g. 1g.10gb" })),
      inp("resources.gpu.share.computePercent", "Share: compute %", num(g.share?.computePercent, { min: 1, max: 100 })),
      inp("resources.gpu.share.memoryMiB", "Share: memory (MiB)", num(g.share?.memoryMiB, { min: 1 })),
      inp("resources.cpuMilli", "CPU (millicores)", num(fr.resources?.cpuMilli, { min: 0 })),
      inp("resources.memoryMiB", "Memory (MiB)", num(fr.resources?.memoryMiB, { min: 0 })),
    ),
    h(
      "fieldset",
      h("legend", "Run"),
      inp("run.image", "Image", text(run.image, { placeholder: "e.g. gpuplane.localhost/busybox" })),
      inp("run.command", "Command", text([...(run.command || []), ...(run.args || [])].map((w) => (/\s/.test(w) ? JSON.stringify(w) : w)).join(" "), { placeholder: "sh -c 'echo hi'" }), "quoted as in a shell"),
      inp("run.env", "Environment", area(kv(run.env), { placeholder: "KEY=value, one a line" })),
      inp("run.duration", "Duration", text(durationDefault), "a simulated run's length; with an image or a command, a time limit when changed"),
      inp("run.exitCode", "Exit code (simulated)", num(run.exitCode ?? 0, { min: 0, max: 255 })),
      inp("run.checkpoint", "Checkpoint on request and before moves", h("input", { type: "checkbox", checked: !!run.checkpoint })),
    ),
    h(
      "fieldset",
      h("legend", "Placement"),
      inp("nodeSelector", "Machine labels", area(kv(fr.nodeSelector), { placeholder: "zone=eu-1, one a line" })),
      inp("tolerations", "Tolerations", area((fr.tolerations || []).map((t) => t.operator === "Exists" ? `${t.key}:Exists${t.effect ? ":" + t.effect : ""}` : `${t.key}=${t.value || ""}${t.effect ? ":" + t.effect : ""}`).join("\n"), { placeholder: "key=value:NoSchedule or key:Exists, one a line" })),
      inp("labels", "Job labels", area(kv(fr.labels), { placeholder: "team=ml, one a line" })),
    ),
    h("button", { type: "submit", testid: "submit-button" }, "Submit"),
    result,
  );
  const val = (p) => inputs.find((i) => i.path === p).el;
  const n = (p) => (val(p).value === "" ? undefined : Number(val(p).value));
  const s = (p) => val(p).value.trim() || undefined;

  const clearErrors = () => {
    general.hidden = true;
    general.replaceChildren();
    for (const i of inputs) {
      i.err.hidden = true;
      i.err.textContent = "";
      i.el.removeAttribute("aria-invalid");
    }
  };
  // showErrors puts each field error next to its input (the closest
  // field by path), each once; those without an input go in the box on
  // top, with the message when no field is named.
  const showErrors = (err) => {
    const unplaced = [];
    const shown = new Set();
    for (const fe of err.fields || []) {
      const path = (fe.field || "").replace(/\[\d+\]/g, "");
      const target = inputs
        .filter((i) => path === i.path || path.startsWith(i.path + "."))
        .sort((a, b) => b.path.length - a.path.length)[0] ||
        inputs.find((i) => i.path.toLowerCase() === path.toLowerCase());
      const line = fe.message || fe.reason;
      if (!target) {
        unplaced.push(`${fe.field}: ${line}`);
        continue;
      }
      const k = target.path + "\0" + line;
      if (shown.has(k)) continue;
      shown.add(k);
      target.err.hidden = false;
      target.err.textContent = target.err.textContent ? target.err.textContent + "; " + line : line;
      target.el.setAttribute("aria-invalid", "true");
    }
    if (!shown.size || unplaced.length) {
      general.hidden = false;
      replace(general, shown.size ? "Some fields need fixing." : err.message, unplaced.length ? h("ul", unplaced.map((u) => h("li", u))) : null);
    }
    const first = inputs.find((i) => !i.err.hidden);
    (first ? first.el : general).focus?.();
  };

  form.onsubmit = async (ev) => {
    ev.preventDefault();
    clearErrors();
    result.textContent = "";
    const share = n("resources.gpu.share.computePercent") != null || n("resources.gpu.share.memoryMiB") != null
      ? { computePercent: n("resources.gpu.share.computePercent"), memoryMiB: n("resources.gpu.share.memoryMiB") } : undefined;
    const cmd = words(val("run.command").value);
    const runSpec = { image: s("run.image"), checkpoint: val("run.checkpoint").checked || undefined };
    if (cmd.length) runSpec.command = cmd;
    const env = pairs(val("run.env").value);
    if (Object.keys(env).length) runSpec.env = env;
    // A simulated run (no image, no command) takes duration and exit code;
    // otherwise duration is a time limit, sent only when changed.
    if (!runSpec.image && !cmd.length) {
      runSpec.duration = s("run.duration");
      runSpec.exitCode = n("run.exitCode");
    } else if (s("run.duration") && s("run.duration") !== durationDefault) runSpec.duration = s("run.duration");
    const model = val("resources.gpu.model").value;
    const body = {
      schemaVersion: 1,
      id: s("id"),
      name: s("name"),
      pool: s("pool"),
      priority: val("priority").value,
      dependsOn: val("dependsOn").value.split(/[\s,]+/).filter(Boolean),
      expectedRunTime: s("expectedRunTime"),
      placementTimeout: s("placementTimeout"),
      resources: {
        gpu: {
          count: n("resources.gpu.count"),
          model: model && model !== "any" ? model : undefined,
          memoryMiB: n("resources.gpu.memoryMiB"),
          nodes: n("resources.gpu.nodes") > 1 ? n("resources.gpu.nodes") : undefined,
          topology: val("resources.gpu.topology").value || undefined,
          migProfile: s("resources.gpu.migProfile"),
          share,
        },
        cpuMilli: n("resources.cpuMilli"),
        memoryMiB: n("resources.memoryMiB"),
      },
      run: runSpec,
      nodeSelector: pairs(val("nodeSelector").value),
      tolerations: tolerations(val("tolerations").value),
      labels: pairs(val("labels").value),
    };
    for (const k of ["dependsOn", "tolerations"]) if (!body[k].length) delete body[k];
    for (const k of ["nodeSelector", "labels"]) if (!Object.keys(body[k]).length) delete body[k];
    try {
      const res = await api("POST", `/v1/tenants/${enc(tenant)}/jobs`, body);
      const id = res.jobId || res.id || body.id;
      result.textContent = "✓ submitted " + id;
      navigate(`/ui/jobs/${enc(tenant)}/${enc(id)}`);
    } catch (err) {
      if (err instanceof ApiError) showErrors(err);
      else {
        general.hidden = false;
        general.textContent = err.message;
      }
    }
  };
  replace(main, h("p", h("a", { href: "/ui/jobs?tenant=" + enc(tenant) }, "← Jobs")), form);
}
