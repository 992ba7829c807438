package gateway

import (
	"cmp"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// GET /v1/fleet/events streams the fleet as the console draws it: a
// snapshot of every node (inventory, lifecycle, holds, and per GPU its
// owners, MIG slices, shares, health and utilisation), then one "node"
// event per node that changed. The fleet hub below is shared by every
// stream: it remembers, per node, the version of its last change and
// nothing else, so a stream holds no history and no queue. Each stream
// wakes when something changed, asks which nodes changed since the
// version it last sent, and sends each of them as it now is: a slow
// reader gets fewer, coalesced events, never a growing backlog.
//
// Versions are microsecond timestamps made strictly increasing (a hybrid
// clock), so an event's id means "the fleet as of then" to every replica
// and across restarts. Last-Event-ID resumes with the nodes changed since
// that id less resumeMargin (a node sent twice is harmless: each event is
// the node's whole state); an id older than this process's start, or
// ahead of its clock, gets a new snapshot, since the removals before it
// are not known here.
//
// What a caller sees: a platform admin the whole fleet; any other caller
// with a role on some tenant (as GET /v1/nodes) the same machines and
// GPUs, but the owners of other tenants' work as hidden: it learns that a
// GPU is taken, not by whom.

// resumeMargin is how far before a resumed id changes are sent again: a
// replica may have applied a change a little before or after another.
const resumeMargin = 5 * time.Second

// fleetFlushEvery bounds how often one stream sends deltas: changes in
// between are coalesced into one event per node.
const fleetFlushEvery = 250 * time.Millisecond

// fleetWriteTimeout bounds one batch's write to a reader (a variable for
// the test of an idle stream).
var fleetWriteTimeout = 30 * time.Second

// Telemetry moves a GPU's event only when it moves this much: a fleet of
// 2,000 machines samples every second.
const (
	utilStep = 5.0 // percentage points
	tempStep = 3.0 // °C
)

// fleetHub is the gateway's fleet view beyond the node model: who holds
// which GPU (from the job read model's placements), the GPUs' last
// health facts and telemetry, and the change versions.
type fleetHub struct {
	nodes *nodeModel
	model readModel

	// vmu guards the versions and the subscribers; it is taken inside
	// nodeModel's lock (changed) and never held while taking another.
	vmu     sync.Mutex
	clock   uint64 // the last version handed out
	start   uint64 // the first version of this process
	version map[string]uint64
	subs    map[chan struct{}]struct{}

	// dmu guards what follows.
	dmu sync.RWMutex
	// jobs are the jobs holding devices now (scheduled, running), by
	// tenant/job; onNode the jobs per node.
	jobs   map[jobKey][]contracts.Placement
	onNode map[string]map[jobKey]struct{}
	// tenants is every tenant a job event named.
	tenants map[string]struct{}
	health  map[string]map[string]contracts.GPUHealth // node -> GPU UUID
	util    map[string]map[string]contracts.GPUUtil   // node -> GPU UUID

	now func() time.Time
}

type jobKey struct{ tenant, job string }

func newFleetHub(nodes *nodeModel, model readModel, now func() time.Time) *fleetHub {
	h := &fleetHub{nodes: nodes, model: model, now: now, version: map[string]uint64{}, subs: map[chan struct{}]struct{}{},
		jobs: map[jobKey][]contracts.Placement{}, onNode: map[string]map[jobKey]struct{}{}, tenants: map[string]struct{}{},
		health: map[string]map[string]contracts.GPUHealth{}, util: map[string]map[string]contracts.GPUUtil{}}
	h.start = h.tick()
	return h
}

// tick returns the next version; vmu is held or the hub is not shared yet.
func (h *fleetHub) tick() uint64 {
	v := uint64(h.now().UnixMicro())
	if v <= h.clock {
		v = h.clock + 1
	}
	h.clock = v
	return v
}

// changed records that node changed and wakes every stream.
func (h *fleetHub) changed(node string) {
	h.vmu.Lock()
	defer h.vmu.Unlock()
	h.version[node] = h.tick()
	for c := range h.subs {
		select {
		case c <- struct{}{}:
		default: // already woken
		}
	}
}

// current returns the clock: every change up to it is visible.
func (h *fleetHub) current() uint64 {
	h.vmu.Lock()
	defer h.vmu.Unlock()
	return h.clock
}

// subscribe returns a channel that is signalled after changes, and its
// cancel.
func (h *fleetHub) subscribe() (<-chan struct{}, func()) {
	c := make(chan struct{}, 1)
	h.vmu.Lock()
	h.subs[c] = struct{}{}
	h.vmu.Unlock()
	return c, func() {
		h.vmu.Lock()
		delete(h.subs, c)
		h.vmu.Unlock()
	}
}

// changedSince returns the nodes changed after v, ordered by ID, and the
// clock they are read at.
func (h *fleetHub) changedSince(v uint64) ([]string, uint64) {
	h.vmu.Lock()
	defer h.vmu.Unlock()
	var out []string
	for n, nv := range h.version {
		if nv > v {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out, h.clock
}

// observeJob folds a job's new status into the owners index: a job that
// holds devices (scheduled, running) is on the nodes of its placements;
// any other is on none. Both the nodes it left and those it is on change.
func (h *fleetHub) observeJob(st contracts.JobStatus) {
	k := jobKey{st.Tenant, st.JobID}
	var now []contracts.Placement
	if st.State == contracts.StateScheduled || st.State == contracts.StateRunning {
		now = st.Placements
		if len(now) == 0 && st.Placement != nil {
			now = []contracts.Placement{*st.Placement}
		}
	}
	h.dmu.Lock()
	h.tenants[st.Tenant] = struct{}{}
	before := h.jobs[k]
	if slices.EqualFunc(before, now, samePlacement) {
		h.dmu.Unlock()
		return
	}
	touched := map[string]struct{}{}
	for _, p := range before {
		touched[p.NodeID] = struct{}{}
		delete(h.onNode[p.NodeID], k)
	}
	if len(now) == 0 {
		delete(h.jobs, k)
	} else {
		h.jobs[k] = now
	}
	for _, p := range now {
		touched[p.NodeID] = struct{}{}
		if h.onNode[p.NodeID] == nil {
			h.onNode[p.NodeID] = map[jobKey]struct{}{}
		}
		h.onNode[p.NodeID][k] = struct{}{}
	}
	h.dmu.Unlock()
	for n := range touched {
		h.changed(n)
	}
}

func samePlacement(a, b contracts.Placement) bool {
	return a.AllocationID == b.AllocationID && a.NodeID == b.NodeID
}

// applyHealth records a GPU's last health fact.
func (h *fleetHub) applyHealth(ev contracts.HealthEvent) {
	h.dmu.Lock()
	m := h.health[ev.NodeID]
	if m == nil {
		m = map[string]contracts.GPUHealth{}
		h.health[ev.NodeID] = m
	}
	if cur, ok := m[ev.GPUUUID]; ok && cur.Time.After(ev.Time) {
		h.dmu.Unlock()
		return
	}
	m[ev.GPUUUID] = contracts.GPUHealth{Kind: ev.Kind, Code: ev.Code, Healthy: ev.Healthy, Message: ev.Message, Time: ev.Time}
	h.dmu.Unlock()
	h.changed(ev.NodeID)
}

// applyTelemetry records a machine's samples; the node changes only when
// a GPU's use or temperature moved by a step, or its owner or health did
// (the console shows those, not every second's noise).
func (h *fleetHub) applyTelemetry(t contracts.Telemetry) {
	h.dmu.Lock()
	m := h.util[t.NodeID]
	if m == nil {
		m = map[string]contracts.GPUUtil{}
		h.util[t.NodeID] = m
	}
	moved := false
	for _, g := range t.GPUs {
		u := contracts.GPUUtil{GPUUtil: g.GPUUtil, FBUsedMiB: g.FBUsedMiB, TempC: g.TempC, PowerW: g.PowerW, Time: t.Time}
		cur, ok := m[g.UUID]
		if ok && cur.Time.After(t.Time) {
			continue
		}
		if !ok || math.Abs(cur.GPUUtil-u.GPUUtil) >= utilStep || math.Abs(cur.TempC-u.TempC) >= tempStep {
			m[g.UUID] = u
			moved = true
		}
	}
	h.dmu.Unlock()
	if moved {
		h.changed(t.NodeID)
	}
}

// view is the caller's filter: nil tenants means everything shows.
type fleetView struct {
	tenants func(string) bool // nil: a platform admin
}

// node builds one node as the caller sees it; ok is false when the node
// is not listed (no inventory yet, or its machine went away).
func (h *fleetHub) node(id string, v fleetView) (contracts.FleetNode, bool) {
	st, ok := h.nodes.node(id)
	if !ok {
		return contracts.FleetNode{}, false
	}
	h.dmu.RLock()
	defer h.dmu.RUnlock()
	return h.build(st, v), true
}

// build assembles a FleetNode; dmu is held for reading.
func (h *fleetHub) build(st contracts.NodeStatus, v fleetView) contracts.FleetNode {
	n := contracts.FleetNode{NodeID: st.NodeID, Hostname: st.Hostname, Pool: st.Pool, Zone: st.Zone, MachineType: st.MachineType,
		PriceClass: st.PriceClass, Backend: st.Backend, Labels: st.Labels, Taints: st.Taints, CPUMilli: st.CPUMilli,
		MemoryMiB: st.MemoryMiB, Lifecycle: st.Lifecycle, LifecycleAt: st.LifecycleAt, Admin: st.Admin,
		GPUs: make([]contracts.FleetGPU, len(st.GPUs))}
	byUUID := make(map[string]int, len(st.GPUs))
	for i, g := range st.GPUs {
		n.GPUs[i] = contracts.FleetGPU{Index: g.Index, UUID: g.UUID, Model: g.Model, MemoryMiB: g.MemoryMiB,
			NVLinkDomain: g.NVLinkDomain, Healthy: g.Healthy, MIGEnabled: g.MIGEnabled, MIGInstances: g.MIGInstances, MPS: g.MPS}
		if hv, ok := h.health[st.NodeID][g.UUID]; ok {
			n.GPUs[i].Health = &hv
		}
		if u, ok := h.util[st.NodeID][g.UUID]; ok {
			n.GPUs[i].Util = &u
		}
		byUUID[g.UUID] = i
	}
	jobs := make([]jobKey, 0, len(h.onNode[st.NodeID]))
	for k := range h.onNode[st.NodeID] {
		jobs = append(jobs, k)
	}
	slices.SortFunc(jobs, func(a, b jobKey) int { return cmp.Or(cmp.Compare(a.tenant, b.tenant), cmp.Compare(a.job, b.job)) })
	for _, k := range jobs {
		for _, p := range h.jobs[k] {
			if p.NodeID != st.NodeID {
				continue
			}
			for _, d := range p.Devices {
				i, ok := byUUID[d.UUID]
				if !ok {
					continue
				}
				o := contracts.GPUOwner{Tenant: k.tenant, JobID: k.job, AllocationID: p.AllocationID, Share: d.Share,
					MilliGPUs: d.MilliGPUs()}
				if d.MIG != nil {
					o.MIG = d.MIG.UUID
				}
				if v.tenants != nil && !v.tenants(k.tenant) {
					o.Tenant, o.JobID, o.AllocationID, o.Hidden = "", "", "", true
				}
				n.AllocatedMilliGPUs += o.MilliGPUs
				n.GPUs[i].Owners = append(n.GPUs[i].Owners, o)
			}
		}
	}
	n.UpdatedAt = time.UnixMicro(int64(h.versionOf(st.NodeID))).UTC()
	return n
}

func (h *fleetHub) versionOf(node string) uint64 {
	h.vmu.Lock()
	defer h.vmu.Unlock()
	return h.version[node]
}

// snapshot builds every listed node as the caller sees it.
func (h *fleetHub) snapshot(v fleetView) []contracts.FleetNode {
	list := h.nodes.list("")
	out := make([]contracts.FleetNode, len(list))
	h.dmu.RLock()
	defer h.dmu.RUnlock()
	for i, st := range list {
		out[i] = h.build(st, v)
	}
	return out
}

// noteTenant adds a tenant a job event named (a read model snapshot's
// tenants whose jobs are all retired: no status of theirs is observed).
func (h *fleetHub) noteTenant(t string) {
	h.dmu.Lock()
	h.tenants[t] = struct{}{}
	h.dmu.Unlock()
}

// knownTenants returns every tenant a job event named, sorted.
func (h *fleetHub) knownTenants() []string {
	h.dmu.RLock()
	defer h.dmu.RUnlock()
	out := make([]string, 0, len(h.tenants))
	for t := range h.tenants {
		out = append(out, t)
	}
	slices.Sort(out)
	return out
}

// follow reads GPU health facts (NODES, every one: the last per GPU is
// kept) and live telemetry (TELEMETRY, from now: only the latest sample
// matters) until ctx ends. Neither gates readiness: the fleet shows
// without them, and gains them as they come.
func (h *fleetHub) follow(ctx context.Context, b *bus.Bus, log interface {
	Warn(string, ...any)
}) error {
	done := make(chan error, 2)
	go func() {
		spec := bus.FollowSpec{Stream: contracts.StreamNodes, FilterSubjects: []string{contracts.SubjectNodeHealthAll}}
		done <- b.Follow(ctx, spec, func(_ context.Context, m *bus.Msg) error {
			var ev contracts.HealthEvent
			if err := m.Decode(&ev); err != nil || contracts.ValidateID(ev.NodeID) != nil || ev.GPUUUID == "" {
				log.Warn("fleet: skipping a health event that does not decode", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
				return nil
			}
			h.applyHealth(ev)
			return nil
		}, nil)
	}()
	go func() {
		spec := bus.FollowSpec{Stream: contracts.StreamTelemetry, FilterSubjects: []string{contracts.SubjectTelemetryAll}, New: true}
		done <- b.Follow(ctx, spec, func(_ context.Context, m *bus.Msg) error {
			var t contracts.Telemetry
			if err := m.Decode(&t); err != nil || contracts.ValidateID(t.NodeID) != nil {
				log.Warn("fleet: skipping telemetry that does not decode", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
				return nil
			}
			h.applyTelemetry(t)
			return nil
		}, nil)
	}()
	// A read that fails leaves the fleet without health or telemetry, not
	// the gateway down: it is logged, and the other read goes on.
	for range 2 {
		if err := <-done; err != nil && ctx.Err() == nil {
			log.Warn("fleet: a read stopped; GPUs show without health or telemetry", "err", err)
		}
	}
	return nil
}

// viewOf is the caller's view of the fleet.
func viewOf(r *http.Request) (fleetView, bool) {
	p, ok := principalFrom(r.Context())
	if !ok {
		return fleetView{}, false
	}
	if p.isPlatformAdmin() {
		return fleetView{}, true
	}
	return fleetView{tenants: func(t string) bool { return p.has(contracts.RoleViewer, t) }}, true
}

// streamGzip reports whether the request's Accept-Encoding takes gzip
// (with no q=0).
func streamGzip(r *http.Request) bool {
	for _, v := range r.Header.Values("Accept-Encoding") {
		for part := range strings.SplitSeq(v, ",") {
			name, params, _ := strings.Cut(strings.TrimSpace(part), ";")
			if strings.EqualFold(strings.TrimSpace(name), "gzip") && strings.ReplaceAll(params, " ", "") != "q=0" {
				return true
			}
		}
	}
	return false
}

// fleetEvents serves GET /v1/fleet/events.
func (s *server) fleetEvents(w http.ResponseWriter, r *http.Request) {
	after, ok := lastEventID(w, r)
	if !ok || !s.nodeModelReady(w) {
		return
	}
	view, ok := viewOf(r)
	if !ok {
		s.unauthorized(w, r, refused(contracts.ReasonUnauthenticated, "no credentials"))
		return
	}
	if view.tenants != nil {
		// The route has no tenant to count the stream against: a
		// caller's fleet streams are bounded per caller instead, by the
		// same number a tenant's streams are.
		p, _ := principalFrom(r.Context())
		release, ok := s.limits.openStream("fleet:" + p.Subject)
		if !ok {
			w.Header().Set("Retry-After", "5")
			writeError(w, http.StatusTooManyRequests, contracts.ReasonTooManyStreams,
				fmt.Sprintf("%s has %d fleet streams open, the most a caller may", p.Subject, s.limits.cfg.StreamsPerTenant), nil)
			return
		}
		defer release()
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(s.streams, cancel)()
	wake, unsubscribe := s.fleet.subscribe()
	defer unsubscribe()

	rc := http.NewResponseController(w)
	hd := w.Header()
	hd.Set("Content-Type", "text/event-stream")
	hd.Set("Cache-Control", "no-cache")
	hd.Set("X-Accel-Buffering", "no")
	hd.Add("Vary", "Accept-Encoding")
	// A snapshot of a large fleet is megabytes of repetitive JSON: gzip
	// (at its fastest level) takes it to a tenth, for the browsers and
	// clients that ask; each batch is flushed through it.
	var out io.Writer = w
	var gz *gzip.Writer
	if streamGzip(r) {
		hd.Set("Content-Encoding", "gzip")
		gz, _ = gzip.NewWriterLevel(w, gzip.BestSpeed)
		defer gz.Close()
		out = gz
	}
	w.WriteHeader(http.StatusOK)
	// A reader that takes longer than fleetWriteTimeout for one batch
	// (or heartbeat) is cut off: the gateway holds nothing for it
	// meanwhile, and it resumes with its id. The deadline is set before
	// each batch and cleared once it is flushed, so an idle stream lives.
	begin := func() { _ = rc.SetWriteDeadline(time.Now().Add(fleetWriteTimeout)) }
	send := func(id uint64, ev contracts.FleetEvent) bool {
		data, err := json.Marshal(ev)
		if err != nil {
			s.log.Error("fleet event does not encode", "err", err)
			return false
		}
		_, err = fmt.Fprintf(out, "event: %s\nid: %d\ndata: %s\n\n", ev.Type, id, data)
		return err == nil
	}
	flush := func() bool {
		if gz != nil && gz.Flush() != nil {
			return false
		}
		if rc.Flush() != nil {
			return false
		}
		_ = rc.SetWriteDeadline(time.Time{})
		return true
	}
	begin()
	if _, err := fmt.Fprint(out, ": stream open\n\n"); err != nil || !flush() {
		return
	}
	redacted := view.tenants != nil
	sent := after
	cur := s.fleet.current()
	margin := uint64(resumeMargin.Microseconds())
	if after == 0 || after < s.fleet.start || after > cur {
		// A snapshot as of cur: whatever changes while it is built is
		// sent again after it, as each node now is.
		nodes := s.fleet.snapshot(view)
		begin()
		if !send(cur, contracts.FleetEvent{Type: contracts.FleetSnapshot, Nodes: nodes, Redacted: redacted, Time: s.now().UTC()}) || !flush() {
			return
		}
		sent = cur
	} else if sent > margin {
		sent -= margin
	} else {
		sent = 0
	}
	heartbeat := time.NewTicker(s.cfg.Heartbeat)
	defer heartbeat.Stop()
	for {
		ids, clock := s.fleet.changedSince(sent)
		if len(ids) > 0 {
			begin()
			for i, id := range ids {
				ev := contracts.FleetEvent{Type: contracts.FleetNodeChanged, NodeID: id, Redacted: redacted, Time: s.now().UTC()}
				if n, ok := s.fleet.node(id, view); ok {
					ev.Node = &n
				} else {
					ev.Removed = true
				}
				// Every event but the batch's last carries the id
				// before the batch: a reader cut off mid-batch resumes
				// with the whole batch again.
				id := sent
				if i == len(ids)-1 {
					id = clock
				}
				if !send(id, ev) {
					return
				}
			}
			if !flush() {
				return
			}
			sent = clock
		}
		select {
		case <-ctx.Done():
			return
		case <-heartbeat.C:
			begin()
			if _, err := fmt.Fprint(out, ": heartbeat\n\n"); err != nil || !flush() {
				return
			}
			continue
		case <-wake:
		}
		// Coalesce: what changes within the window goes in one batch.
		select {
		case <-ctx.Done():
			return
		case <-time.After(fleetFlushEvery):
		}
	}
}
