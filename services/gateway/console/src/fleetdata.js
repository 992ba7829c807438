// Reading a node as the gateway sends it: GET /v1/fleet/events nodes (with
// owners and utilisation per GPU) or GET /v1/nodes's NodeStatus (without).
// The accessors accept both, so the console works before and after the
// fleet stream exists.

export const nodeId = (n) => n.nodeId || n.id || "";

export function gpusOf(n) {
  return n.gpus || n.inventory?.gpus || [];
}

// owners of a GPU: who holds it (tenant, job, allocation), with the MIG
// slice or share each holds.
export function ownersOf(g) {
  const o = g.owners || g.allocations || (g.owner ? [g.owner] : []);
  return o.map((x) => ({
    // hidden: another tenant's work, shown without its names.
    tenant: x.tenant || "",
    jobId: x.jobId || x.job || "",
    allocationId: x.allocationId || x.allocation || "",
    mig: x.mig || x.migUuid || x.migProfile || null,
    share: x.share || null,
    hidden: !!x.hidden,
  }));
}

// sample is a GPU's latest telemetry.
export function sampleOf(g) {
  return g.telemetry || g.sample || g.util || g;
}

export function utilOf(g) {
  const s = sampleOf(g);
  const v = s.gpuUtil ?? s.utilization ?? s.utilisation;
  if (v == null || typeof v !== "number") return null;
  return v <= 1 && v > 0 && !Number.isInteger(v) ? v * 100 : v;
}

export function adminOf(n) {
  return n.admin || n.holds || {};
}

export function holdOf(n, g) {
  return g.hold || adminOf(n).gpus?.[g.uuid] || null;
}

// healthy: the inventory's flag and the latest sample's, if any.
export function healthyOf(g) {
  const s = sampleOf(g);
  return g.healthy !== false && s.healthy !== false && g.health?.healthy !== false;
}

// gpuState is one word for a GPU, shown with its icon and used by the
// state filter: unhealthy, draining, cordoned, busy or free.
export function gpuState(n, g) {
  if (!healthyOf(g)) return "unhealthy";
  const hold = holdOf(n, g);
  const a = adminOf(n);
  if (hold?.drain || a.drain) return "draining";
  if (hold?.cordoned || a.cordoned) return "cordoned";
  return ownersOf(g).length ? "busy" : "free";
}

// spotNotice is the node's reclaim deadline when its cloud gave notice.
export function spotNotice(n) {
  const a = adminOf(n);
  if (a.deadline && (a.cause === "spot_interruption" || n.priceClass === "spot" || !a.cause)) return a.deadline;
  return n.spotDeadline || n.spot?.deadline || null;
}

export function nodeState(n) {
  const a = adminOf(n);
  const gpus = gpusOf(n);
  if (n.lifecycle === "lost") return "lost";
  if (gpus.some((g) => !healthyOf(g))) return "unhealthy";
  if (spotNotice(n)) return "spot";
  if (a.drain) return "draining";
  if (a.cordoned) return "cordoned";
  return gpus.some((g) => ownersOf(g).length) ? "busy" : "free";
}

// poolStats: allocation ratio (GPUs with an owner over usable GPUs) and
// fragmentation (the share of free GPUs stranded on machines that are
// partly used, where a whole-machine request cannot go).
export function poolStats(nodes) {
  let total = 0, used = 0, free = 0, stranded = 0, unhealthy = 0, held = 0;
  for (const n of nodes) {
    const gs = gpusOf(n);
    let nFree = 0, nUsed = 0;
    for (const g of gs) {
      total++;
      const st = gpuState(n, g);
      if (st === "unhealthy") unhealthy++;
      else if (st === "cordoned" || st === "draining") held++;
      else if (st === "busy") nUsed++;
      else nFree++;
    }
    used += nUsed;
    free += nFree;
    if (nUsed > 0) stranded += nFree;
  }
  const usable = used + free;
  return {
    machines: nodes.length,
    total,
    used,
    free,
    unhealthy,
    held,
    allocation: usable ? used / usable : 0,
    fragmentation: free ? stranded / free : 0,
  };
}
