package gateway

import (
	"net/http"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// waitingJob queues a job of tenant in pool ("" for none) with a pending
// reason, as the scheduler says why it waits.
func (h *harness) waitingJob(tenant, job, pool string, prio contracts.Priority, at time.Time, reason contracts.Reason, msg string) {
	h.t.Helper()
	q := queued(tenant, job, at)
	q.Request.Pool, q.Request.Priority = pool, prio
	h.publishEvent(q)
	h.publishNth(contracts.JobEvent{Type: contracts.EventPending, Tenant: tenant, JobID: job, Attempt: 1, Time: at.Add(time.Second),
		Reason: reason, Message: msg}, 1)
}

func tenantQueue(l contracts.QueueList, pool, tenant string) *contracts.TenantQueue {
	for _, p := range l.Pools {
		if p.Pool != pool {
			continue
		}
		for i := range p.Tenants {
			if p.Tenants[i].Tenant == tenant {
				return &p.Tenants[i]
			}
		}
	}
	return nil
}

// TestQueuesShowWhatWaitsAndWhy: a pending job with the scheduler's
// reason and its reservation, what the tenant holds against its quota,
// the fair-share order and the classes; a tenant's caller sees only its
// tenants, and a pool filter keeps one pool.
func TestQueuesShowWhatWaitsAndWhy(t *testing.T) {
	h := startGateway(t, nil, func(h *harness) { h.publishInventory(inventory("sim-1", "sim"), 1) })
	h.waitNode("sim-1")
	if s, body := h.do(http.MethodPut, "/v1/quotas/acme", `{"weight":2,"pools":{"h100":{"guarantee":4,"max":8}}}`, nil); s != http.StatusOK {
		t.Fatalf("quota: %d %s", s, body)
	}
	h.place("acme", "run", "sim-1", 0, 1) // acme holds 2 GPUs of h100
	reserved := "capacity reserved on sim-1 from 2026-11-22T13:00:00Z (in 25m), when running jobs are expected to end"
	h.waitingJob("acme", "big", "h100", contracts.PriorityNormal, t0, contracts.PendingInsufficientGPUs,
		"needs 2×H100-80GB; largest free block is 1 on sim-1; "+reserved)
	h.waitingJob("acme", "urgent", "h100", contracts.PriorityCritical, t0.Add(time.Minute), contracts.PendingQuotaExceeded,
		"quota acme/h100 at 8 of 8 GPUs")
	h.place("globex", "g-run", "sim-1", 2) // globex holds 1 GPU, weight 1
	h.waitingJob("globex", "any", "", contracts.PriorityHigh, t0, contracts.PendingNoNodes, "no nodes")

	var l contracts.QueueList
	h.eventually("every job in the queues", func() bool {
		l = contracts.QueueList{}
		s, _ := h.do(http.MethodGet, "/v1/queues", "", &l)
		a, g := tenantQueue(l, "h100", "acme"), tenantQueue(l, "*", "globex")
		return s == 200 && a != nil && len(a.Waiting) == 2 && a.Waiting[1].Reason != "" && a.Running == 1 &&
			g != nil && len(g.Waiting) == 1 && g.Waiting[0].Reason != "" && tenantQueue(l, "h100", "globex") != nil
	})
	acme := tenantQueue(l, "h100", "acme")
	if acme.Quota == nil || acme.Quota.Guarantee != 4 || acme.Quota.Max == nil || *acme.Quota.Max != 8 || acme.Weight != 2 ||
		acme.UsedGPUs != 2 || acme.Share != 1 {
		t.Fatalf("acme in h100: quota %+v weight %g used %g share %g", acme.Quota, acme.Weight, acme.UsedGPUs, acme.Share)
	}
	// Highest class first: urgent (critical) before big (normal).
	urgent, big := acme.Waiting[0], acme.Waiting[1]
	if urgent.JobID != "urgent" || urgent.Reason != contracts.PendingQuotaExceeded || urgent.Priority != contracts.PriorityCritical ||
		big.JobID != "big" || big.Reason != contracts.PendingInsufficientGPUs || big.Reservation != reserved || big.GPUs != 2 ||
		urgent.Reservation != "" || !big.QueuedAt.Equal(t0) {
		t.Fatalf("acme's waiting jobs: %+v", acme.Waiting)
	}
	if acme.WaitingByPriority["critical"] != 1 || acme.WaitingByPriority["normal"] != 1 {
		t.Fatalf("acme's waiting by class: %v", acme.WaitingByPriority)
	}
	// Fair share in h100: acme holds 2 at weight 2 (share 1), globex 1 at
	// weight 1 (share 1): a tie, by name.
	globex := tenantQueue(l, "h100", "globex")
	if acme.Order != 1 || globex.Order != 2 || globex.UsedGPUs != 1 || globex.Quota != nil {
		t.Fatalf("order acme %d globex %d (globex used %g quota %+v)", acme.Order, globex.Order, globex.UsedGPUs, globex.Quota)
	}
	if len(l.Priorities) != 4 || l.Priorities[0] != contracts.PriorityCritical {
		t.Fatalf("priorities %v", l.Priorities)
	}

	// acme's viewer sees acme only.
	viewer := h.issue("acme-viewer", contracts.Binding{Role: RoleViewer, Tenant: "acme"})
	var mine contracts.QueueList
	if s, ae := h.as(viewer, http.MethodGet, "/v1/queues", "", &mine); s != http.StatusOK {
		t.Fatalf("viewer: %d %+v", s, ae)
	}
	for _, p := range mine.Pools {
		for _, tq := range p.Tenants {
			if tq.Tenant != "acme" {
				t.Fatalf("acme's viewer sees tenant %s in pool %s", tq.Tenant, p.Pool)
			}
		}
	}
	if tenantQueue(mine, "h100", "acme") == nil {
		t.Fatalf("acme's viewer does not see acme: %+v", mine)
	}

	var one contracts.QueueList
	if s, _ := h.do(http.MethodGet, "/v1/queues?pool=*", "", &one); s != http.StatusOK || len(one.Pools) != 1 || one.Pools[0].Pool != "*" {
		t.Fatalf("?pool=*: %d %+v", s, one)
	}
	var ae contracts.APIError
	if s, _ := h.do(http.MethodGet, "/v1/queues?pool=Not_A_Pool", "", &ae); s != http.StatusBadRequest || ae.Error.Reason != contracts.ReasonInvalidValue {
		t.Fatalf("a bad pool: %d %+v", s, ae)
	}
}
