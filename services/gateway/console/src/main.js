// The console's shell: login, the header (navigation, tenant picker, who
// is signed in) and a history-API router. Every view is a URL under /ui/
// (the gateway answers each with this app), so a deep link or a reload
// lands on the same view.
import { h, replace, field } from "./dom.js";
import { api, get, tryGet, session, hooks } from "./api.js";
import { fleetPage, nodePage } from "./fleet.js";
import { queuesPage } from "./queues.js";
import { jobsPage, jobPage, submitPage } from "./jobs.js";
import { costPage } from "./cost.js";
import { opsPage } from "./ops.js";

const routes = [
  [/^\/ui\/fleet\/?$/, fleetPage, "fleet"],
  [/^\/ui\/fleet\/nodes\/([^/]+)\/?$/, nodePage, "fleet", ["node"]],
  [/^\/ui\/queues\/?$/, queuesPage, "queues"],
  [/^\/ui\/jobs\/?$/, jobsPage, "jobs"],
  [/^\/ui\/jobs\/new\/?$/, submitPage, "jobs"],
  [/^\/ui\/jobs\/([^/]+)\/([^/]+)\/?$/, jobPage, "jobs", ["tenant", "id"]],
  [/^\/ui\/cost\/?$/, costPage, "cost"],
  [/^\/ui\/ops\/?$/, opsPage, "ops"],
];

const nav = [
  ["fleet", "Fleet", "/ui/fleet"],
  ["queues", "Queues", "/ui/queues"],
  ["jobs", "Jobs", "/ui/jobs"],
  ["cost", "Cost", "/ui/cost"],
  ["ops", "Operations", "/ui/ops"],
];

const app = document.getElementById("app");
let me = null; // WhoAmI
let tenants = []; // the tenants the caller may see
let current = null; // AbortController of the view on screen

export const ctx = {
  get me() {
    return me;
  },
  get tenants() {
    return tenants;
  },
  // isAdmin: the platform admin sees the fleet and operations and may act.
  get isAdmin() {
    return !!me && (me.bindings || []).some((b) => b.role === "platform-admin");
  },
  // can tells whether the caller holds role (or a greater one) on tenant.
  can(role, tenant) {
    const rank = { viewer: 1, member: 2, "tenant-admin": 3 };
    return ctx.isAdmin || (me?.bindings || []).some((b) => b.tenant === tenant && (rank[b.role] || 0) >= (rank[role] || 0));
  },
  get tenant() {
    const q = new URLSearchParams(location.search).get("tenant");
    return q || sessionStorage.getItem("gpuplane.tenant") || tenants[0] || "";
  },
  set tenant(t) {
    sessionStorage.setItem("gpuplane.tenant", t);
  },
  navigate,
};

export function navigate(url, replaceState) {
  if (replaceState) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  render(true);
}

// Links inside the app move through history, not page loads.
document.addEventListener("click", (ev) => {
  const a = ev.target.closest && ev.target.closest("a[href]");
  if (!a || ev.defaultPrevented || ev.button !== 0 || ev.metaKey || ev.ctrlKey || ev.shiftKey || a.target) return;
  const url = new URL(a.href, location.href);
  if (url.origin !== location.origin || !url.pathname.startsWith("/ui/") || url.pathname.startsWith("/ui/assets/")) return;
  ev.preventDefault();
  navigate(url.pathname + url.search + url.hash);
});
window.addEventListener("popstate", () => render(true));
// Leaving the document ends the view (its streams, timers and charts; api.js
// aborts every stream too); a page the browser kept and shows again
// (back/forward cache) draws its view anew, live again.
window.addEventListener("pagehide", () => current && current.abort());
window.addEventListener("pageshow", (ev) => ev.persisted && render());

hooks.onUnauthorized = () => {
  session.token = "";
  me = null;
  render();
};

async function loadIdentity() {
  me = await api("GET", "/v1/whoami", undefined, { quiet401: true });
  const listed = await tryGet("/v1/tenants").catch(() => null);
  let names = [];
  if (listed) {
    const arr = Array.isArray(listed) ? listed : listed.tenants || [];
    names = arr.map((t) => (typeof t === "string" ? t : t.tenant || t.name)).filter(Boolean);
  } else {
    // Before GET /v1/tenants: the caller's bindings, and for the platform
    // admin every tenant with a quota.
    names = (me.bindings || []).map((b) => b.tenant).filter(Boolean);
    if (ctx.isAdmin) {
      const q = await tryGet("/v1/quotas").catch(() => null);
      for (const d of q?.quotas || []) names.push(d.tenant);
    }
  }
  tenants = [...new Set(names)].sort();
}

// render draws the view of the URL. moved: the user went there inside the
// app, so focus goes to the new view (a screen reader announces it), as a
// page load would.
async function render(moved) {
  if (current) current.abort();
  current = new AbortController();
  const signal = current.signal;
  if (!session.token) return loginView();
  if (!me) {
    try {
      await loadIdentity();
    } catch (e) {
      if (e.status === 401) session.token = "";
      return loginView(e.status === 401 ? "Your session has ended or the token was refused: " + e.message : e.message);
    }
    if (signal.aborted) return;
  }
  let path = location.pathname;
  if (path === "/" || path === "/ui" || path === "/ui/") {
    path = ctx.isAdmin ? "/ui/fleet" : "/ui/jobs";
    history.replaceState(null, "", path + location.search);
  }
  const route = routes.find(([re]) => re.test(path));
  const main = h("main#main", { tabindex: "-1" });
  replace(app, header(route ? route[2] : ""), main);
  if (!route) {
    replace(main, h("h1", "Not found"), h("p", "No view at ", h("code", path), ". ", h("a", { href: "/ui/jobs" }, "Jobs")));
    return;
  }
  const [re, page, , names = []] = route;
  const m = re.exec(path);
  const params = {};
  names.forEach((n, i) => (params[n] = decodeURIComponent(m[i + 1])));
  try {
    await page(main, { params, query: new URLSearchParams(location.search), signal });
  } catch (e) {
    if (!signal.aborted) main.append(h("p.error", { role: "alert", testid: "page-error" }, "Could not load this view: " + e.message));
  }
  if (signal.aborted) return;
  document.title = (main.querySelector("h1")?.textContent || "gpuplane") + " · gpuplane console";
  if (moved && !main.contains(document.activeElement)) main.focus({ preventScroll: false });
}

function header(active) {
  const picker = h(
    "select#tenant-picker",
    {
      testid: "tenant-picker",
      onchange: (ev) => {
        ctx.tenant = ev.target.value;
        const q = new URLSearchParams(location.search);
        q.set("tenant", ev.target.value);
        navigate(location.pathname.replace(/^\/ui\/jobs\/[^/]+\/[^/]+$/, "/ui/jobs") + "?" + q);
      },
    },
    tenants.map((t) => h("option", { value: t, selected: t === ctx.tenant }, t)),
  );
  if (!tenants.includes(ctx.tenant) && ctx.tenant) picker.prepend(h("option", { value: ctx.tenant, selected: true }, ctx.tenant));
  return h(
    "header.top",
    h("a.brand", { href: "/ui/" + (ctx.isAdmin ? "fleet" : "jobs") }, "gpuplane"),
    h(
      "nav",
      { "aria-label": "Views" },
      h(
        "ul",
        // Operations is the platform admin's (GET /v1/ops/events).
        nav.filter(([key]) => key !== "ops" || ctx.isAdmin).map(([key, label, href]) =>
          h("li", h("a", { href, testid: "nav-" + key, "aria-current": key === active ? "page" : null }, label)),
        ),
      ),
    ),
    h(
      "div.who",
      h("label.tenant", { for: "tenant-picker" }, "Tenant "),
      picker,
      h("span.user", { testid: "whoami", title: me?.subject || "" }, me?.name || me?.subject || ""),
      h(
        "button.link",
        {
          type: "button",
          testid: "logout",
          onclick: async () => {
            // A session this console signed in (LDAP) is revoked, so the
            // token dies with it; a pasted API token is only forgotten.
            const t = session.token;
            if (sessionStorage.getItem("gpuplane.login") === "1" && t.startsWith("gpt_") && t.length > 48) {
              await api("DELETE", "/v1/tokens/" + encodeURIComponent(t.slice(4, t.length - 44)), undefined, { quiet401: true }).catch(() => {});
            }
            sessionStorage.removeItem("gpuplane.login");
            session.token = "";
            me = null;
            render();
          },
        },
        "Sign out",
      ),
    ),
  );
}

async function loginView(message) {
  const cfg = await get("/v1/auth/config").catch(() => ({}));
  const err = h("p.error", { role: "alert", testid: "login-error", hidden: !message }, message || "");
  const user = h("input", { name: "username", autocomplete: "username", testid: "login-username", required: true });
  const pass = h("input", { name: "password", type: "password", autocomplete: "current-password", testid: "login-password", required: true });
  const token = h("input", { name: "token", type: "password", autocomplete: "off", testid: "login-token", spellcheck: "false" });
  const submit = async (ev) => {
    ev.preventDefault();
    err.hidden = true;
    try {
      if (ev.target === ldapForm) {
        const res = await api("POST", "/v1/login", { username: user.value, password: pass.value }, { quiet401: true });
        session.token = res.token;
        sessionStorage.setItem("gpuplane.login", "1");
      } else {
        session.token = token.value.trim();
        sessionStorage.removeItem("gpuplane.login");
      }
      me = null;
      await render();
    } catch (e) {
      err.textContent = e.message;
      err.hidden = false;
    }
  };
  const ldapForm = h(
    "form.card",
    { testid: "login-form", onsubmit: submit, "aria-label": "Sign in with user name and password" },
    h("h2", "Sign in"),
    field("User name", user),
    field("Password", pass),
    h("button", { type: "submit", testid: "login-submit" }, "Sign in"),
  );
  const tokenForm = h(
    "form.card",
    { testid: "token-form", onsubmit: submit, "aria-label": "Sign in with a token" },
    h("h2", cfg.ldap ? "…or with a token" : "Sign in with a token"),
    field(
      "API token",
      token,
      cfg.oidc
        ? "An API token (gpt_…) or an ID token from " + cfg.oidc.issuer
        : "An API token (gpt_…): make run prints the folder of its tokens (admin.token for the platform admin, demo-acme.token for a member of acme).",
    ),
    h("button", { type: "submit", testid: "token-submit" }, "Use token"),
  );
  replace(app, h("main#main.login", h("h1", "gpuplane console"), err, cfg.ldap ? ldapForm : null, tokenForm));
}

render();
