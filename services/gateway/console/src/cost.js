// Cost: usage and cost over time per pool and price class (uPlot charts
// from the tenant's usage records), per tenant for whoever sees several,
// the month's invoice, the budget with its alert levels and what spot
// saved.
import { h, replace, field, badge, money, fmtTime, safeId } from "./dom.js";
import { api, get, tryGet, enc } from "./api.js";
import { ctx } from "./main.js";
import { lineChart } from "./charts.js";

// A point is one step's usage of one pool and price class (and tenant):
// {t: its start in unix seconds, pool, priceClass, tenant, gpuS (GPU
// seconds), cost, saved}.

// seriesPoints reads GET /v1/tenants/{tenant}/usage/series: daily, or
// hourly when the usage spans fewer than three days; null where the
// gateway has no such route.
export async function seriesPoints(tenant, signal) {
  const url = (step) => `/v1/tenants/${enc(tenant)}/usage/series?step=${step}`;
  let s = await tryGet(url("day"), { signal }).catch(() => null);
  if (!s) return null;
  if (new Set((s.points || []).map((p) => p.start)).size < 3) s = (await tryGet(url("hour"), { signal }).catch(() => null)) || s;
  return {
    step: s.step === "hour" ? 3600 : 86400,
    currency: s.currency || "",
    points: (s.points || []).filter((p) => isFinite(Date.parse(p.start))).map((p) => ({
      t: Math.floor(Date.parse(p.start) / 1000),
      pool: p.pool,
      priceClass: p.priceClass || "",
      tenant,
      gpuS: (p.gpuMillis || 0) / 1000,
      cost: (p.costMicros || 0) / 1e6,
      saved: (p.savedMicros || 0) / 1e6,
    })),
  };
}

// recordPoints buckets usage records by step where there is no series.
export function recordPoints(records, step, tenant) {
  return records
    .map((r) => ({ r, t: Math.floor(new Date(r.start || r.time).getTime() / 1000) }))
    .filter(({ t }) => isFinite(t))
    .map(({ r, t }) => ({
      t: Math.floor(t / step) * step,
      pool: r.pool,
      priceClass: r.priceClass || "",
      tenant: r.tenant || tenant,
      gpuS: (r.gpuMillis || 0) / 1000,
      cost: (r.costMicros || 0) / 1e6,
      saved: ((r.onDemandCostMicros || 0) - (r.costMicros || 0)) / 1e6,
    }));
}

// chartData sums val(point) per key(point) and step, every step from the
// first to the last (a step without usage is 0) and one either side, so a
// single step still has a time range.
export function chartData(points, key, val, step) {
  if (!points.length) return { xs: [], series: [] };
  const ts = points.map((p) => p.t);
  const lo = Math.min(...ts) - step;
  const n = Math.min(3000, Math.round((Math.max(...ts) - lo) / step) + 2);
  const xs = Array.from({ length: n }, (_, i) => lo + i * step);
  const by = new Map();
  for (const p of points) {
    const k = key(p) || "–";
    if (!by.has(k)) by.set(k, new Array(n).fill(0));
    const i = Math.round((p.t - lo) / step);
    if (i >= 0 && i < n) by.get(k)[i] += val(p);
  }
  return { xs, series: [...by.entries()].sort().map(([label, values]) => ({ label, values })) };
}

// num shows small amounts with their digits.
const num = (v) => (v === 0 ? "0" : Math.abs(v) < 0.01 ? v.toPrecision(2) : v.toFixed(2));

// gpuTime shows GPU time in the unit that fits it: a second-long job's
// usage is "3.2 GPU-s", not "0.00" GPU hours.
export function gpuTime(ms) {
  const v = (ms || 0) / 1000;
  const u = timeUnit(v);
  return num(v / u.seconds) + " " + u.name;
}

// timeUnit is the unit of GPU time (GPU-s, GPU-min, GPU-h) for an amount
// of GPU seconds.
export function timeUnit(seconds) {
  const a = Math.abs(seconds);
  if (a > 0 && a < 60) return { name: "GPU-s", seconds: 1 };
  if (a > 0 && a < 3600) return { name: "GPU-min", seconds: 60 };
  return { name: "GPU-h", seconds: 3600 };
}

export async function costPage(main, { query, signal }) {
  const tenant = ctx.tenant;
  const period = query.get("period") || new Date().toISOString().slice(0, 7);
  const charts = [];
  signal.addEventListener("abort", () => charts.forEach((c) => c.destroy()));
  const [usage, invoice, budget] = await Promise.all([
    get(`/v1/tenants/${enc(tenant)}/usage`, { signal }),
    get(`/v1/tenants/${enc(tenant)}/invoice?period=${enc(period)}`, { signal }).catch((e) => ({ error: e.message })),
    tryGet(`/v1/tenants/${enc(tenant)}/budget`, { signal }).catch(() => null),
  ]);
  const recs = usage.byJob || [];
  let ser = await seriesPoints(tenant, signal);
  if (!ser) {
    const span = recs.length ? (Math.max(...recs.map((r) => new Date(r.end || r.start).getTime())) - Math.min(...recs.map((r) => new Date(r.start).getTime()))) / 1000 : 0;
    const st = span > 4 * 86400 ? 86400 : 3600;
    ser = { step: st, currency: "", points: recordPoints(recs, st, tenant) };
  }
  const cur = usage.currency || ser.currency || invoice.currency || "";
  const step = ser.step;
  const stepName = step === 86400 ? "day" : "hour";
  const periodIn = h("input", { type: "month", value: period.slice(0, 7), testid: "cost-period" });
  periodIn.onchange = () => ctx.navigate(`/ui/cost?tenant=${enc(tenant)}&period=${enc(periodIn.value)}`);

  const chartBox = (title, testid) => h("figure.chart", { testid }, h("figcaption", title));
  // The GPU time chart's unit is the one that fits its largest step.
  const gpuUnit = timeUnit(Math.max(0, ...ser.points.map((p) => p.gpuS)));
  const poolGpu = chartBox(`GPU time per ${stepName} (${gpuUnit.name}), by pool`, "cost-chart-gpu-pool");
  // Without a price book nothing is priced: the cost charts and tiles say
  // so once instead of drawing zeros in no currency ("()").
  const priced = !!cur || (usage.costMicros || 0) > 0;
  const inCur = cur ? ` (${cur})` : "";
  const classCost = chartBox(`Cost per ${stepName}${inCur}, by price class`, "cost-chart-cost-class");
  const tenantsBox = chartBox(`Cost per ${stepName}${inCur}, by tenant`, "cost-chart-tenants");
  const savedBox = chartBox(`Saved by spot and reserved capacity per ${stepName}${inCur}`, "cost-chart-saved");

  const b = budget?.budget, st = budget?.status;
  const spent = st?.spentMicros || 0, limit = st?.limitMicros || 0;
  replace(
    main,
    h("div.page-head", h("h1", "Cost of ", h("span", { testid: "cost-tenant" }, tenant)), field("Invoice month", periodIn)),
    h(
      "section.tiles",
      priced
        ? h("div.tile", { testid: "cost-total" }, h("div.big", money(usage.costMicros, cur)), "usage cost so far")
        : h("div.tile", { testid: "cost-total" }, h("div.big", "–"), "not priced"),
      h("div.tile", { testid: "cost-gpu-hours" }, h("div.big", gpuTime(usage.gpuMillis)), "GPU time"),
      priced
        ? h(
            "div.tile",
            { testid: "spot-savings" },
            h("div.big", invoice.spotSavings ? invoice.spotSavings + (cur ? " " + cur : "") : money(invoice.spotSavingsMicros || 0, cur)),
            "saved by spot this month",
            invoice.onDemandEquivalent ? ` (vs ${invoice.onDemandEquivalent}${cur ? " " + cur : ""} on demand)` : "",
          )
        : null,
    ),
    priced ? null : h("p.note", { testid: "no-pricebook" }, "No price book set: usage is metered but not priced, so costs, savings and the invoice's amounts are empty until an operator sets one."),
    ser.points.length
      ? [poolGpu, priced ? [classCost, savedBox, ctx.tenants.length > 1 ? tenantsBox : null] : null]
      : h("p", { testid: "cost-empty" }, "No usage recorded for this tenant yet."),
    h(
      "section",
      { testid: "budget" },
      h("h2", "Budget"),
      b
        ? [
            h("p", `${money(spent, cur)} of ${money(limit, cur)} this ${b.period === "daily" ? "day" : "month"} (${st?.periodName || ""}); policy: ${b.policy}`),
            h("meter", { min: 0, max: limit || 1, value: spent, high: (limit || 1) * 0.8, optimum: 0, "aria-label": "budget spent" }),
            h(
              "p",
              { testid: "budget-levels" },
              "Alert levels: ",
              [50, 80, 100].map((lvl) => {
                const crossed = (st?.crossed || st?.alerted || []).includes(lvl) || (limit && spent >= (limit * lvl) / 100);
                return h("span.tag", { "data-state": crossed ? "crossed" : "not-crossed" }, (crossed ? "⚠ " : "○ ") + lvl + "%" + (crossed ? " crossed" : ""));
              }),
              st?.exceeded ? badge("failed", "exceeded") : null,
            ),
          ]
        : h("p", "No budget set."),
      ctx.can("tenant-admin", tenant) ? budgetForm(tenant, b, cur) : null,
    ),
    h(
      "section",
      { testid: "invoice" },
      h("h2", "Invoice ", invoice.period || period),
      invoice.error
        ? h("p.error", invoice.error)
        : [
            h(
              "table",
              h("thead", h("tr", ["Pool", "Price class", "GPU", "GPU time", "Rate", "Cost", "On-demand"].map((c) => h("th", { scope: "col" }, c)))),
              h(
                "tbody",
                (invoice.lines || []).map((l) =>
                  h(
                    "tr",
                    h("td", l.pool),
                    h("td", l.priceClass),
                    h("td", l.gpuModel),
                    h("td.num", gpuTime(l.gpuMillis)),
                    h("td.num", priced ? money(l.gpuRateMicros, (cur ? cur + " " : "") + "per GPU-h") : "–"),
                    h("td.num", priced ? l.cost : "–"),
                    h("td.num", priced ? money(l.onDemandCostMicros) : "–"),
                  ),
                ),
              ),
              h("tfoot", h("tr", h("th", { colspan: 5, scope: "row" }, "Total"), h("td.num", { testid: "invoice-total" }, priced ? invoice.total + (invoice.currency ? " " + invoice.currency : "") : "–"), h("td"))),
            ),
            (invoice.byClass || []).length
              ? h("p", "By price class: ", invoice.byClass.map((c) => h("span.tag", `${c.priceClass} ${c.cost}${c.savings && c.savings !== "0" && c.savings !== "0.00" ? " (saved " + c.savings + ")" : ""}`)))
              : null,
            // Said once: without a price book the note above says it all.
            priced && invoice.unpricedGpuMillis ? h("p.note", { testid: "unpriced" }, "⚠ ", gpuTime(invoice.unpricedGpuMillis), " not yet priced (no rate in the price book)") : null,
          ],
    ),
  );
  if (ser.points.length) {
    const pts = ser.points;
    charts.push(lineChart(poolGpu, { ...chartData(pts, (p) => p.pool, (p) => p.gpuS / gpuUnit.seconds, step), yLabel: gpuUnit.name, fmt: num }));
    if (!priced) return;
    charts.push(lineChart(classCost, { ...chartData(pts, (p) => p.priceClass, (p) => p.cost, step), yLabel: cur, fmt: num }));
    charts.push(lineChart(savedBox, { ...chartData(pts, (p) => p.priceClass, (p) => p.saved, step), yLabel: cur, fmt: num }));
    if (ctx.tenants.length > 1) {
      // Every tenant the caller sees (12 at most), at this page's step.
      const others = await Promise.all(
        ctx.tenants.slice(0, 12).map(async (t) => {
          if (t === tenant) return pts;
          const o = await seriesPoints(t, signal).catch(() => null);
          if (o && o.step === step) return o.points;
          const u = await get(`/v1/tenants/${enc(t)}/usage`, { signal }).catch(() => null);
          return recordPoints(u?.byJob || [], step, t);
        }),
      );
      if (!signal.aborted) charts.push(lineChart(tenantsBox, { ...chartData(others.flat(), (p) => p.tenant, (p) => p.cost, step), yLabel: cur, fmt: num }));
    }
  }
}

function budgetForm(tenant, b, cur) {
  const limit = h("input", { inputmode: "decimal", value: b?.limit ?? "", testid: "budget-limit" });
  const period = h("select", { testid: "budget-period" }, ["monthly", "daily"].map((p) => h("option", { selected: b?.period === p }, p)));
  const policy = h("select", { testid: "budget-policy" }, ["notify", "reject", "spot-only"].map((p) => h("option", { selected: b?.policy === p }, p)));
  const msg = h("p.note", { role: "status" });
  return h(
    "form.inline",
    {
      testid: "budget-form",
      onsubmit: async (ev) => {
        ev.preventDefault();
        try {
          await api("PUT", `/v1/tenants/${enc(tenant)}/budget`, { schemaVersion: 1, tenant, limit: limit.value, period: period.value, policy: policy.value });
          msg.textContent = "✓ saved";
        } catch (e) {
          msg.textContent = "✗ " + e.message + (e.fields || []).map((f) => ` ${f.field}: ${f.message}`).join(";");
        }
      },
    },
    field(`Limit${cur ? " (" + cur + ")" : ""}`, limit),
    field("Period", period),
    field("Policy", policy),
    h("button", { type: "submit" }, "Save budget"),
    msg,
  );
}
