// h builds an element: h("tag.class#id", {attrs, on*: handler}, ...children).
// Text children become text nodes, so API data is never parsed as HTML.
export function h(spec, attrs, ...children) {
  const m = /^([a-z0-9]+)?((?:[.#][\w-]+)*)$/i.exec(spec);
  const el = document.createElement((m && m[1]) || "div");
  if (m && m[2]) {
    for (const part of m[2].match(/[.#][\w-]+/g)) {
      if (part[0] === ".") el.classList.add(part.slice(1));
      else el.id = part.slice(1);
    }
  }
  if (attrs != null && attrs !== false && (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs))) {
    children.unshift(attrs);
    attrs = null;
  }
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "testid") el.setAttribute("data-testid", v);
    // value as the attribute (the default value): a form reset, and tools
    // that clear the attribute, see it.
    else if (k === "value") el.setAttribute("value", String(v));
    else if (k in el && typeof v !== "string") el[k] = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c == null || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

// replace puts children in place of el's.
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

// field is a labelled input: every input of the console has a label.
export function field(label, input, hint) {
  const id = input.id || (input.id = "f-" + Math.random().toString(36).slice(2, 9));
  return h("div.field", h("label", { for: id }, label), input, hint ? h("small.hint", hint) : null);
}

// status is a state shown as text and icon, never colour alone.
const icons = {
  succeeded: "✓", running: "▶", queued: "…", pending: "…", scheduled: "◷", failed: "✗", cancelled: "⊘",
  migrating: "⇄", healthy: "✓", unhealthy: "✗", cordoned: "⛔", draining: "⇣", spot: "⚠", free: "○", busy: "●",
  firing: "⚠", resolved: "✓",
};
export function badge(state, text) {
  const s = String(state || "unknown");
  return h("span.badge.s-" + s.replace(/[^\w-]/g, ""), { "data-state": s }, (icons[s] || "•") + " " + (text || s));
}

export function fmtTime(t) {
  if (!t) return "";
  const d = new Date(t);
  if (isNaN(d)) return String(t);
  return d.toLocaleString(undefined, { hour12: false });
}

export function ago(t) {
  if (!t) return "";
  const s = Math.round((Date.now() - new Date(t).getTime()) / 1000);
  if (!isFinite(s)) return "";
  const a = Math.abs(s);
  const v = a < 60 ? a + "s" : a < 3600 ? Math.round(a / 60) + "m" : a < 86400 ? Math.round(a / 3600) + "h" : Math.round(a / 86400) + "d";
  return s >= 0 ? v + " ago" : "in " + v;
}

export function money(micros, currency) {
  if (micros == null) return "";
  return (micros / 1e6).toFixed(2) + (currency ? " " + currency : "");
}

export function mib(n) {
  if (n == null) return "";
  return n >= 1024 ? (n / 1024).toFixed(n % 1024 ? 1 : 0) + " GiB" : n + " MiB";
}

// safeId turns an ID into something usable in an id or data-testid.
export function safeId(s) {
  return String(s).replace(/[^\w.-]/g, "_");
}
