// Operations: the OPS stream (alerts firing and resolved, scale decisions,
// machine events, migrations, preemptions) with links to the jobs and
// machines involved, and the platform admin's actions: cordon and drain,
// quotas, pool policy and the price book.
import { h, replace, field, badge, fmtTime, ago, safeId } from "./dom.js";
import { api, get, stream, enc } from "./api.js";
import { ctx } from "./main.js";

const TYPES = ["alert", "scale", "machine", "migration", "preemption"];
const KEEP = 500;

function links(ev) {
  const out = [];
  for (const n of ev.nodes || []) out.push(h("a.tag", { href: "/ui/fleet/nodes/" + enc(n) }, "machine " + n));
  for (const j of ev.jobs || []) out.push(h("a.tag", { href: `/ui/jobs/${enc(j.tenant)}/${enc(j.jobId)}` }, "job " + j.tenant + "/" + j.jobId));
  if (ev.pool) out.push(h("a.tag", { href: "/ui/fleet?pool=" + enc(ev.pool) }, "pool " + ev.pool));
  return out;
}

export async function opsPage(main, { query, signal }) {
  const list = h("ol.events", { testid: "ops-events", "aria-live": "polite" });
  const firing = h("tbody");
  const mode = h("span.mode", { role: "status", testid: "ops-live" }, "connecting…");
  const typeSel = h("select", { testid: "ops-type" }, h("option", { value: "" }, "all kinds"), TYPES.map((t) => h("option", { value: t, selected: t === query.get("type") }, t)));
  const alerts = new Map(); // key → alert
  const drawAlerts = () =>
    replace(
      firing,
      alerts.size
        ? [...alerts.values()].map((a) =>
            h(
              "tr",
              { testid: "alert-" + safeId(a.key) },
              h("td", badge(a.state === "resolved" ? "resolved" : "firing", a.state || "firing")),
              h("td", a.severity || ""),
              h("td", a.kind),
              h("td", a.message),
              h("td", { title: fmtTime(a.since) }, ago(a.since)),
              h("td", Object.entries(a.labels || {}).map(([k, v]) => (k === "node" ? h("a.tag", { href: "/ui/fleet/nodes/" + enc(v) }, v) : h("span.tag", k + "=" + v)))),
            ),
          )
        : h("tr", h("td", { colspan: 6 }, "✓ No alert firing.")),
    );
  drawAlerts();
  const filter = () => {
    for (const li of list.children) li.hidden = !!typeSel.value && li.dataset.type !== typeSel.value;
    const q = new URLSearchParams(location.search);
    typeSel.value ? q.set("type", typeSel.value) : q.delete("type");
    history.replaceState(null, "", location.pathname + (q.toString() ? "?" + q : ""));
  };
  typeSel.onchange = filter;
  replace(
    main,
    h("div.page-head", h("h1", "Operations"), mode),
    h("section", h("h2", "Alerts"), h("table", { testid: "ops-alerts" }, h("thead", h("tr", ["State", "Severity", "Kind", "Message", "Since", "Labels"].map((c) => h("th", { scope: "col" }, c)))), firing)),
    ctx.isAdmin ? adminActions(signal) : null,
    h("section", h("h2", "Events"), h("form.filters", { onsubmit: (e) => e.preventDefault() }, field("Kind", typeSel)), list),
  );
  stream("/v1/ops/events", {
    signal,
    onStatus: (s) => {
      mode.dataset.state = s;
      mode.textContent = s === "live" ? "● live" : s === "forbidden" ? "✗ operations are a platform admin's view" : "… " + s;
    },
    onEvent: (name, ev, id) => {
      if (name === "dropped") return; // the stream reconnects and resumes after the last id
      const type = ev.type || name;
      if (ev.alert) {
        if (ev.alert.state === "resolved") alerts.set(ev.alert.key, ev.alert);
        else alerts.set(ev.alert.key, ev.alert);
        drawAlerts();
      }
      const li = h(
        "li",
        { testid: "ops-event", "data-type": type, "data-id": id || "" },
        h("time", { datetime: ev.time, title: fmtTime(ev.time) }, fmtTime(ev.time)),
        " ",
        badge(type === "alert" ? (ev.alert?.state === "resolved" ? "resolved" : "firing") : type === "migration" ? "migrating" : type, type),
        " ",
        h("span.summary", ev.summary || ""),
        h("div.links", links(ev)),
      );
      li.hidden = !!typeSel.value && type !== typeSel.value;
      list.prepend(li);
      while (list.children.length > KEEP) list.lastElementChild.remove();
    },
  });
}

function result() {
  return h("p.note", { role: "status" });
}

function report(el, p) {
  el.textContent = "…";
  p.then(
    () => (el.textContent = "✓ done"),
    (e) => (el.textContent = "✗ " + e.message + (e.fields || []).map((f) => ` ${f.field}: ${f.message}`).join(";")),
  );
}

// adminActions: forms over the admin endpoints; each shows the API's
// answer, field errors included.
function adminActions(signal) {
  const node = h("input", { testid: "admin-node", placeholder: "node ID", autocomplete: "off" });
  const reason = h("input", { testid: "admin-reason", placeholder: "why" });
  const nodeMsg = result();
  const nodeAct = (what) => report(nodeMsg, api("POST", `/v1/nodes/${enc(node.value.trim())}/${what}`, { reason: reason.value || "from the console" }));

  const qTenant = h("select", { testid: "quota-tenant" });
  const qText = h("textarea", { rows: 6, testid: "quota-json", spellcheck: "false" });
  const qMsg = result();
  let quotas = [];
  const showQuota = () => {
    const d = quotas.find((q) => q.tenant === qTenant.value);
    qText.value = JSON.stringify(d?.quota || { schemaVersion: 1, tenant: qTenant.value, weight: 1, pools: {} }, null, 2);
  };
  qTenant.onchange = showQuota;

  const pSel = h("select", { testid: "pool-name" });
  const pPolicy = h("select", { testid: "pool-policy" }, ["binpack", "spread", "topology", "fragaware"].map((p) => h("option", p)));
  const pMsg = result();
  let pools = [];
  const showPool = () => {
    const d = pools.find((p) => p.pool === pSel.value);
    pPolicy.value = d?.config?.policy || "binpack";
  };
  pSel.onchange = showPool;

  const book = h("textarea", { rows: 10, testid: "pricebook-json", spellcheck: "false" });
  const bMsg = result();
  let bookRev = 0;

  (async () => {
    const [q, p, b] = await Promise.all([
      get("/v1/quotas", { signal }).catch(() => ({ quotas: [] })),
      get("/v1/pools", { signal }).catch(() => ({ pools: [] })),
      get("/v1/pricebook", { signal }).catch(() => null),
    ]);
    quotas = q.quotas || [];
    const names = [...new Set([...quotas.map((x) => x.tenant), ...ctx.tenants])].sort();
    replace(qTenant, names.map((t) => h("option", t)));
    showQuota();
    pools = p.pools || [];
    replace(pSel, pools.map((x) => h("option", x.pool)));
    showPool();
    if (b) {
      book.value = JSON.stringify(b.book, null, 2);
      bookRev = b.revision || 0;
    }
  })();

  return h(
    "section.admin",
    { testid: "admin-actions", "aria-label": "Administration" },
    h("h2", "Administration"),
    h(
      "div.grid",
      h(
        "form.card",
        { testid: "admin-node-form", onsubmit: (e) => e.preventDefault() },
        h("h3", "Machine"),
        field("Node", node),
        field("Reason", reason),
        h(
          "div.actions",
          h("button", { type: "button", testid: "admin-cordon", onclick: () => nodeAct("cordon") }, "Cordon"),
          h("button", { type: "button", testid: "admin-drain", onclick: () => nodeAct("drain") }, "Drain"),
          h("button", { type: "button", testid: "admin-uncordon", onclick: () => nodeAct("uncordon") }, "Uncordon"),
        ),
        nodeMsg,
      ),
      h(
        "form.card",
        {
          testid: "quota-form",
          onsubmit: (e) => {
            e.preventDefault();
            let body;
            try {
              body = JSON.parse(qText.value);
            } catch (err) {
              qMsg.textContent = "✗ not JSON: " + err.message;
              return;
            }
            const rev = quotas.find((x) => x.tenant === qTenant.value)?.revision;
            report(qMsg, api("PUT", `/v1/quotas/${enc(qTenant.value)}${rev ? "?revision=" + rev : ""}`, body).then(async () => {
              quotas = (await get("/v1/quotas")).quotas || [];
            }));
          },
        },
        h("h3", "Quota"),
        field("Tenant", qTenant),
        field("Quota (weight, guarantee and max per pool)", qText),
        h("button", { type: "submit" }, "Save quota"),
        qMsg,
      ),
      h(
        "form.card",
        {
          testid: "pool-form",
          onsubmit: (e) => {
            e.preventDefault();
            const d = pools.find((p) => p.pool === pSel.value);
            const cfg = { ...(d?.config || { schemaVersion: 1, pool: pSel.value }), policy: pPolicy.value };
            delete cfg.updatedAt;
            report(pMsg, api("PUT", `/v1/pools/${enc(pSel.value)}${d?.revision ? "?revision=" + d.revision : ""}`, cfg).then(async () => {
              pools = (await get("/v1/pools")).pools || [];
            }));
          },
        },
        h("h3", "Pool policy"),
        field("Pool", pSel),
        field("Placement policy", pPolicy),
        h("button", { type: "submit" }, "Save policy"),
        pMsg,
      ),
      h(
        "form.card",
        {
          testid: "pricebook-form",
          onsubmit: (e) => {
            e.preventDefault();
            let body;
            try {
              body = JSON.parse(book.value);
            } catch (err) {
              bMsg.textContent = "✗ not JSON: " + err.message;
              return;
            }
            report(bMsg, api("PUT", `/v1/pricebook${bookRev ? "?revision=" + bookRev : ""}`, body).then(async () => {
              bookRev = (await get("/v1/pricebook")).revision || 0;
            }));
          },
        },
        h("h3", "Price book"),
        field("Price book (versions by effective date)", book),
        h("button", { type: "submit" }, "Save price book"),
        bMsg,
      ),
    ),
  );
}
