package gateway

import (
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// nextQueues returns the next queues event of a stream (comments
// skipped), failing the test after waitFor or at the stream's end.
func nextQueues(t *testing.T, frames <-chan sseFrame) contracts.QueueList {
	t.Helper()
	f, ok := nextEvent(t, frames)
	if !ok {
		t.Fatal("the queues stream ended")
	}
	var l contracts.QueueList
	if f.Event != "queues" {
		t.Fatalf("event %q, want queues", f.Event)
	}
	if err := json.Unmarshal([]byte(f.Data), &l); err != nil {
		t.Fatalf("queues event %q: %v", f.Data, err)
	}
	if f.ID != strconv.FormatInt(l.Time.UnixMicro(), 10) {
		t.Fatalf("queues event id %q, want the list's time %s in microseconds", f.ID, l.Time)
	}
	return l
}

// waitingIDs lists the waiting jobs of a tenant in a pool.
func waitingIDs(l contracts.QueueList, pool, tenant string) []string {
	q := tenantQueue(l, pool, tenant)
	if q == nil {
		return nil
	}
	var out []string
	for _, w := range q.Waiting {
		out = append(out, w.JobID)
	}
	return out
}

// tenantsIn lists every tenant a queue list shows.
func tenantsIn(l contracts.QueueList) map[string]bool {
	out := map[string]bool{}
	for _, p := range l.Pools {
		for _, q := range p.Tenants {
			out[q.Tenant] = true
		}
	}
	return out
}

// TestQueuesEventsFollowTheQueues: the stream opens with the whole list,
// sends it again when a job goes pending and when a quota is written,
// sends nothing while idle (only heartbeats), and to a tenant's caller
// only its tenants: another tenant's change wakes its stream but sends
// nothing (the list hashes the same), so its next event is its own
// tenant's next change.
func TestQueuesEventsFollowTheQueues(t *testing.T) {
	h := startGateway(t, func(c *Config) { c.Heartbeat = 20 * time.Millisecond }, nil)
	h.waitingJob("acme", "first", "h100", contracts.PriorityNormal, t0, contracts.PendingInsufficientGPUs, "needs 2×H100-80GB")
	h.eventually("acme's job in the queues", func() bool {
		var l contracts.QueueList
		s, _ := h.do(http.MethodGet, "/v1/queues", "", &l)
		q := tenantQueue(l, "h100", "acme")
		return s == 200 && q != nil && len(q.Waiting) == 1 && q.Waiting[0].Reason != ""
	})
	viewer := h.issue("acme-viewer", contracts.Binding{Role: RoleViewer, Tenant: "acme"})

	admin, _ := h.openStream("/v1/queues/events")
	mine, _ := h.openStream("/v1/queues/events", "Authorization", "Bearer "+viewer)
	for name, frames := range map[string]<-chan sseFrame{"admin": admin, "acme's viewer": mine} {
		l := nextQueues(t, frames)
		if got := waitingIDs(l, "h100", "acme"); len(got) != 1 || got[0] != "first" {
			t.Fatalf("%s's first event: acme waits %v, want [first]", name, got)
		}
	}

	// Idle: heartbeats for longer than the debounce window, no event.
	for beats := 0; beats < 2*int(queuesDebounce/(20*time.Millisecond)); {
		select {
		case f, ok := <-admin:
			if !ok {
				t.Fatal("the admin's stream ended while idle")
			}
			if f.Comment == "" {
				t.Fatalf("an event while nothing changed: %+v", f)
			}
			if f.Comment == "heartbeat" {
				beats++
			}
		case <-time.After(waitFor):
			t.Fatal("no heartbeats while idle")
		}
	}

	// Another tenant's job goes pending: the admin sees it; acme's
	// viewer is sent nothing for it.
	h.waitingJob("globex", "theirs", "h100", contracts.PriorityHigh, t0, contracts.PendingNoNodes, "no nodes")
	for {
		l := nextQueues(t, admin)
		if got := waitingIDs(l, "h100", "globex"); len(got) == 1 && got[0] == "theirs" &&
			tenantQueue(l, "h100", "globex").Waiting[0].Reason == contracts.PendingNoNodes {
			break
		}
	}
	// acme's own next change: the viewer's next event must show it (an
	// event for globex's change would be the list it already has).
	h.waitingJob("acme", "second", "h100", contracts.PriorityCritical, t0.Add(time.Minute), contracts.PendingQuotaExceeded, "quota acme/h100 at 8 of 8 GPUs")
	for {
		l := nextQueues(t, mine)
		if ts := tenantsIn(l); len(ts) != 1 || !ts["acme"] {
			t.Fatalf("acme's viewer was sent tenants %v", ts)
		}
		got := waitingIDs(l, "h100", "acme")
		if len(got) == 1 && got[0] == "first" {
			t.Fatalf("acme's viewer was sent a list it already had: %+v", l)
		}
		// The queued event and then the pending one may come as two
		// events or as one (debounced): wait for the reason.
		if len(got) == 2 && got[0] == "second" && tenantQueue(l, "h100", "acme").Waiting[0].Reason == contracts.PendingQuotaExceeded {
			break
		}
	}

	// A quota written moves the stream.
	if s, body := h.do(http.MethodPut, "/v1/quotas/acme", `{"weight":2,"pools":{"h100":{"guarantee":4,"max":8}}}`, nil); s != http.StatusOK {
		t.Fatalf("quota: %d %s", s, body)
	}
	l := nextQueues(t, mine)
	q := tenantQueue(l, "h100", "acme")
	if q == nil || q.Quota == nil || q.Quota.Guarantee != 4 || q.Weight != 2 {
		t.Fatalf("after the quota: acme in h100 %+v", q)
	}

	// The pool filter keeps one pool; a bad one is refused.
	star, _ := h.openStream("/v1/queues/events?pool=*")
	if l := nextQueues(t, star); len(l.Pools) != 0 {
		t.Fatalf("?pool=*: %+v, want no pools (every job names h100)", l.Pools)
	}
	var ae contracts.APIError
	if s, _ := h.do(http.MethodGet, "/v1/queues/events?pool=Bad_Pool", "", &ae); s != http.StatusBadRequest ||
		ae.Error.Reason != contracts.ReasonInvalidValue {
		t.Fatalf("?pool=Bad_Pool: %d %+v", s, ae)
	}
}

// TestQueueStreamsAreBoundedPerCaller: as the fleet stream, the route
// names no tenant, so a tenant's caller's queue streams are counted per
// caller; a caller without roles is refused.
func TestQueueStreamsAreBoundedPerCaller(t *testing.T) {
	h := startGateway(t, func(c *Config) { c.Limits.StreamsPerTenant = 1 }, nil)
	viewer := h.issue("acme-viewer", contracts.Binding{Role: RoleViewer, Tenant: "acme"})
	frames, stop := h.openStream("/v1/queues/events", "Authorization", "Bearer "+viewer)
	nextQueues(t, frames)
	if s, ae := h.as(viewer, http.MethodGet, "/v1/queues/events", "", nil); s != http.StatusTooManyRequests || ae.Reason != contracts.ReasonTooManyStreams {
		t.Fatalf("a second stream of one caller: %d %+v, want 429 too_many_streams", s, ae)
	}
	for range 2 {
		admin, stopAdmin := h.openStream("/v1/queues/events")
		nextQueues(t, admin)
		defer stopAdmin()
	}
	if s, ae := h.as(h.issue("nobody"), http.MethodGet, "/v1/queues/events", "", nil); s != http.StatusForbidden || ae.Reason != contracts.ReasonForbidden {
		t.Fatalf("a caller without roles: %d %+v, want 403", s, ae)
	}
	stop()
	h.eventually("the caller's stream released", func() bool {
		s, _ := h.probe(http.MethodGet, "/v1/queues/events", "", viewer)
		return s == http.StatusOK
	})
}
