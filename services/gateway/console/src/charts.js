// Charts are uPlot (about 50 KB minified): small, fast, canvas-drawn.
import uPlot from "uplot";
import { h } from "./dom.js";

const palette = ["#2563eb", "#d97706", "#059669", "#7c3aed", "#dc2626", "#0891b2", "#65a30d", "#db2777"];
const dashes = [[], [6, 3], [2, 2], [8, 3, 2, 3]];

// lineChart draws series over time. xs are unix seconds; series is
// [{label, values}]. Each series has its own dash as well as colour, and
// the legend names it, so colour is never the only signal.
export function lineChart(el, { title, xs, series, yLabel, width, height = 220, fmt }) {
  const w = width || Math.max(280, Math.min(el.clientWidth || 900, 1200));
  // The time axis spans the data (chartData pads it one step either
  // side), never uPlot's own rounding of a lone point out to years away.
  const lo = xs.length ? xs[0] : 0, hi = xs.length ? xs[xs.length - 1] : 0;
  el.dataset.xMin = String(lo);
  el.dataset.xMax = String(hi);
  const opts = {
    title,
    width: w,
    height,
    scales: { x: { time: true, range: () => (hi > lo ? [lo, hi] : [lo - 3600, lo + 3600]) } },
    series: [
      {},
      ...series.map((s, i) => ({
        label: s.label,
        stroke: palette[i % palette.length],
        dash: dashes[i % dashes.length],
        width: 2,
        value: (u, v) => (v == null ? "–" : fmt ? fmt(v) : v),
      })),
    ],
    axes: [{}, { label: yLabel, values: (u, vs) => vs.map((v) => (fmt ? fmt(v) : v)), size: 70 }],
  };
  const plot = new uPlot(opts, [xs, ...series.map((s) => s.values)], el);
  const ro = new ResizeObserver(() => {
    const nw = Math.max(280, Math.min(el.clientWidth, 1200));
    if (nw && Math.abs(nw - plot.width) > 4) plot.setSize({ width: nw, height });
  });
  ro.observe(el);
  return { plot, destroy: () => (ro.disconnect(), plot.destroy()) };
}

// sparkline is a tiny chart of the last values (GPU utilisation), with the
// latest value as text beside it.
export function sparkline(label, { max = 100, unit = "%", testid } = {}) {
  const box = h("div.spark", { testid, role: "img", "aria-label": label });
  const text = h("span.spark-value", "–");
  const wrap = h("div.spark-wrap", box, text);
  const xs = [], ys = [];
  let plot = null;
  const push = (v, t = Date.now() / 1000) => {
    if (v == null) return;
    xs.push(t);
    ys.push(v);
    if (xs.length > 120) xs.shift(), ys.shift();
    text.textContent = Math.round(v) + unit;
    box.setAttribute("aria-label", `${label}: ${Math.round(v)}${unit}`);
    // One point draws no line: wait for the second.
    if (!plot && xs.length < 2) return;
    if (!plot) {
      plot = new uPlot(
        {
          width: 140,
          height: 36,
          legend: { show: false },
          cursor: { show: false },
          scales: { x: { time: false }, y: { range: [0, max] } },
          axes: [{ show: false }, { show: false }],
          series: [{}, { stroke: palette[0], fill: "rgba(37,99,235,.15)", width: 1 }],
        },
        [xs, ys],
        box,
      );
    } else plot.setData([xs, ys]);
  };
  return { el: wrap, push };
}
