// Queues: per pool, the tenants in fair-share order with their quota use
// against guarantee and max, and each waiting job with the scheduler's
// reason and any backfill reservation. Live over GET /v1/queues/events:
// each event is the whole list as GET /v1/queues answers it, sent when
// what the caller sees changed (the gateway debounces and skips
// unchanged lists), so the page redraws per event and never polls.
import { h, replace, badge, ago, safeId } from "./dom.js";
import { get, stream, enc } from "./api.js";

function quotaCell(t) {
  const q = t.quota;
  const used = Math.round((t.usedGpus || 0) * 100) / 100;
  if (!q) return h("td", { "data-label": "Quota use" }, used + " GPUs", h("div.sub", "no quota"));
  const max = q.max || 0;
  const over = q.guarantee != null && used > q.guarantee;
  return h(
    "td",
    { "data-label": "Quota use", title: `using ${used} of guarantee ${q.guarantee ?? "–"}, max ${max || "∞"}` },
    max ? h("meter", { min: 0, max, low: q.guarantee || 0, high: max * 0.95, optimum: 0, value: used, "aria-hidden": "true" }) : null,
    ` ${used} / ${q.guarantee ?? "–"} guaranteed / ${max || "∞"} max`,
    over ? h("div.sub", "⚠ above guarantee: borrowed, preemptible") : null,
  );
}

export async function queuesPage(main, { query, signal }) {
  // ?pool= keeps one pool (the gateway filters: GET /v1/queues?pool=).
  const pool = query.get("pool") || "";
  const body = h("div", { testid: "queues" });
  const stamp = h("span.mode", { role: "status", testid: "queues-live" }, "connecting…");
  replace(main, h("div.page-head", h("h1", "Queues"), stamp), body);
  let updated = "";
  const draw = (ql) => {
    updated = new Date().toLocaleTimeString(undefined, { hour12: false });
    stamp.textContent = "● live · updated " + updated;
    const pools = ql.pools || [];
    replace(
      body,
      h("p.note", "Priority classes, served highest first: ", (ql.priorities || []).join(" › ")),
      pool ? h("p", { testid: "queues-pool" }, "Pool ", h("strong", pool), " only. ", h("a", { href: "/ui/queues" }, "All pools")) : null,
      pools.length ? null : h("p", { testid: "queues-empty" }, "Nothing waits and nothing runs."),
      pools.map((p) =>
        h(
          "section.pool",
          { testid: "queue-pool-" + safeId(p.pool), "aria-label": "Pool " + p.pool },
          h("h2", p.pool === "*" ? "Any pool" : h("a", { href: "/ui/queues?pool=" + enc(p.pool) }, "Pool " + p.pool)),
          h(
            "table.queue",
            h("thead", h("tr", ["Order", "Tenant", "Weight", "Quota use", "Running", "Waiting"].map((c) => h("th", { scope: "col" }, c)))),
            h(
              "tbody",
              p.tenants.map((t) =>
                h(
                  "tr",
                  { testid: `queue-${safeId(p.pool)}-${safeId(t.tenant)}` },
                  h("td", { "data-label": "Order" }, "#" + t.order),
                  h("th", { scope: "row" }, h("a", { href: "/ui/jobs?tenant=" + enc(t.tenant) }, t.tenant)),
                  h("td", { "data-label": "Weight" }, t.weight),
                  quotaCell(t),
                  h("td", { "data-label": "Running" }, t.running),
                  h(
                    "td.c-why",
                    { "data-label": "Waiting" },
                    Object.entries(t.waitingByPriority || {}).map(([k, v]) => h("span.tag", `${v} ${k}`)),
                    t.waiting?.length
                      ? h(
                          "ul.waiting",
                          t.waiting.map((w) =>
                            h(
                              "li",
                              { testid: "waiting-" + safeId(w.jobId) },
                              h("a", { href: `/ui/jobs/${enc(t.tenant)}/${enc(w.jobId)}` }, w.jobId),
                              w.name ? h("span.sub", w.name) : null,
                              ` ${w.gpus} GPU · ${w.priority} · queued ${ago(w.queuedAt)}`,
                              w.attempt > 1 ? ` · attempt ${w.attempt}` : "",
                              h("div.clip", { title: [w.reason, w.message].filter(Boolean).join(": ") }, w.reason ? badge("pending", w.reason) : "not yet considered", w.message ? " " + w.message : ""),
                              w.reservation ? h("div.sub", { testid: "reservation" }, "⏲ " + w.reservation) : null,
                            ),
                          ),
                        )
                      : "none",
                  ),
                ),
              ),
            ),
          ),
        ),
      ),
    );
  };
  const qs = pool ? "?pool=" + enc(pool) : "";
  // The stream reconnects with a doubling wait (api.js); each new
  // connection starts with the whole list again.
  stream("/v1/queues/events" + qs, {
    signal,
    onEvent: (name, data) => {
      if (name === "queues") draw(data);
    },
    onStatus: async (s) => {
      if (s === "reconnecting") stamp.textContent = "… reconnecting" + (updated ? " · updated " + updated : "");
      else if (s === "forbidden") stamp.textContent = "✗ no tenant of yours to show";
      else if (s === "missing") {
        // A gateway without the stream: the list once, said to be still.
        try {
          draw(await get("/v1/queues" + qs, { signal }));
          stamp.textContent = "updated " + updated + " (not live: no queue stream on this gateway)";
        } catch (e) {
          if (!signal.aborted) stamp.textContent = "✗ " + e.message;
        }
      }
    },
  });
}
