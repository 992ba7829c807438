// The API client: every call carries the session's Bearer token (kept in
// sessionStorage, never in a URL), and an answer that is not 2xx throws an
// ApiError with the gateway's reason and field errors.
const TOKEN = "gpuplane.token";

export const session = {
  get token() {
    return sessionStorage.getItem(TOKEN) || "";
  },
  set token(v) {
    if (v) sessionStorage.setItem(TOKEN, v);
    else sessionStorage.removeItem(TOKEN);
  },
};

export class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.reason = e.reason || "";
    this.fields = e.fields || [];
  }
}

// onUnauthorized is called on a 401 (the app shows the login).
export const hooks = { onUnauthorized: () => {} };

function headers(extra) {
  const h = { Accept: "application/json", ...extra };
  if (session.token) h.Authorization = "Bearer " + session.token;
  return h;
}

export async function api(method, path, body, opts = {}) {
  const res = await fetch(path, {
    method,
    headers: headers(body !== undefined ? { "Content-Type": "application/json" } : {}),
    body: body !== undefined ? JSON.stringify(body) : undefined,
    signal: opts.signal,
  });
  const text = await res.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = text;
  }
  if (!res.ok) {
    if (res.status === 401 && !opts.quiet401) hooks.onUnauthorized();
    throw new ApiError(res.status, data);
  }
  return data;
}

export const get = (path, opts) => api("GET", path, undefined, opts);

// tryGet is get that answers null where the route does not exist (yet):
// the console falls back to older endpoints.
export async function tryGet(path, opts) {
  try {
    return await get(path, opts);
  } catch (e) {
    if (e.status === 404 && e.reason !== "job_not_found" && e.reason !== "node_not_found") return null;
    throw e;
  }
}

export const enc = encodeURIComponent;

// Every stream and followed log open in this document: each holds one of
// the six HTTP/1.1 connections Chromium allows per host, so each is
// aborted when its view is left (the view's signal) and all of them when
// the document goes away (pagehide), or a few page loads later the next
// request waits about a minute for a connection.
const open = new Set();

// linked is an AbortController that aborts with signal and on pagehide,
// registered in open until it ends.
function linked(signal) {
  const c = new AbortController();
  const stop = () => c.abort();
  if (signal) {
    if (signal.aborted) c.abort();
    else signal.addEventListener("abort", stop, { once: true });
  }
  open.add(c);
  return { signal: c.signal, done: () => (open.delete(c), signal && signal.removeEventListener("abort", stop)) };
}

// abortAll ends every stream of the document (pagehide, beforeunload).
export function abortAll() {
  for (const c of [...open]) c.abort();
  open.clear();
}
addEventListener("pagehide", abortAll);
addEventListener("beforeunload", abortAll);

// stream follows a server-sent event stream with fetch (EventSource cannot
// send an Authorization header). It reconnects with backoff, resuming with
// Last-Event-ID after the last id seen, until signal aborts. onEvent gets
// (name, data parsed as JSON when it is, id). onStatus gets "live",
// "reconnecting", "missing" (a 404: the endpoint does not exist), "forbidden"
// or "ended" (with ends: a stream that finishes by itself, a job's).
export function stream(path, { onEvent, onStatus = () => {}, signal: viewSignal, ends = false, after = "" }) {
  const { signal, done } = linked(viewSignal);
  // after: resume after this event ID from the start (what a list read
  // before the stream already showed).
  let lastId = after && after !== "0" ? after : "";
  let backoff = 500;
  (async () => {
    try {
      await run();
    } finally {
      done();
    }
  })();
  async function run() {
    while (!signal.aborted) {
      try {
        const hdr = headers({ Accept: "text/event-stream" });
        if (lastId) hdr["Last-Event-ID"] = lastId;
        const res = await fetch(path, { headers: hdr, signal });
        if (res.status === 404 || res.status === 405) {
          onStatus("missing");
          return;
        }
        if (res.status === 401) {
          hooks.onUnauthorized();
          return;
        }
        if (res.status === 403) {
          onStatus("forbidden");
          return;
        }
        if (!res.ok) throw new Error("HTTP " + res.status);
        onStatus("live");
        backoff = 500;
        const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value;
          let i;
          while ((i = buf.indexOf("\n\n")) >= 0) {
            const frame = buf.slice(0, i);
            buf = buf.slice(i + 2);
            let name = "message", data = [], id = null;
            for (const line of frame.split("\n")) {
              if (!line || line[0] === ":") continue;
              const c = line.indexOf(":");
              const k = c < 0 ? line : line.slice(0, c);
              const v = c < 0 ? "" : line.slice(c + 1).replace(/^ /, "");
              if (k === "event") name = v;
              else if (k === "data") data.push(v);
              else if (k === "id") id = v;
            }
            if (id != null) lastId = id;
            if (!data.length) continue;
            let d = data.join("\n");
            try {
              d = JSON.parse(d);
            } catch {}
            onEvent(name, d, id);
          }
        }
        if (ends) {
          onStatus("ended");
          return; // a stream that ends by itself (a job's) is done
        }
      } catch (e) {
        if (signal.aborted) return;
      }
      onStatus("reconnecting");
      await new Promise((r) => setTimeout(r, backoff));
      backoff = Math.min(backoff * 2, 10000);
    }
  }
}

// follow reads a text stream (logs) chunk by chunk until it ends or
// signal aborts.
export async function follow(path, onText, viewSignal) {
  const { signal, done } = linked(viewSignal);
  try {
    await followIn(path, onText, signal);
  } finally {
    done();
  }
}

async function followIn(path, onText, signal) {
  const res = await fetch(path, { headers: headers({ Accept: "text/plain" }), signal });
  if (!res.ok) {
    let body = null;
    try {
      body = await res.json();
    } catch {}
    throw new ApiError(res.status, body);
  }
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    onText(value);
  }
}
