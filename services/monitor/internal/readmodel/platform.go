package readmodel

import (
	"cmp"
	"slices"

	"github.com/gpuplane/gpuplane/contracts"
)

// job is what the model keeps of one job: its state, the pool it asked
// for, why it waits, where it last ran, and the attempts whose moves were
// counted.
type job struct {
	state contracts.JobState
	// pool is the pool the request restricts it to ("" for any).
	pool string
	// reason is the last pending reason of a queued job ("" before the
	// scheduler gave one).
	reason contracts.Reason
	// placedPool is the pool of its last placement.
	placedPool string
	// counted[type] is the highest attempt whose event of that type was
	// counted: a redelivered or stale event is not counted twice.
	counted map[contracts.JobEventType]int
}

// NoReason is the reason label of queued jobs the scheduler has not yet
// explained (not yet considered, or just requeued).
const NoReason = "none"

type poolReason struct {
	pool   string
	reason string
}

type moveKey struct {
	pool, reason string
	event        contracts.JobEventType
}

type poolKind struct{ pool, kind string }

// ops holds the platform figures folded from job events and the
// autoscaler's facts. Its callers hold Model.mu.
type ops struct {
	queued     map[poolReason]int // queued jobs, kept at 0 once seen
	requeues   map[poolReason]uint64
	moves      map[moveKey]uint64
	scale      map[poolKind]uint64 // decisions by pool and direction
	machines   map[poolKind]uint64 // machine events by pool and kind
	decisions  map[string]bool     // decision IDs counted
	machineIDs map[string]bool     // machine event IDs counted
	// pools and scaled are the pools whose counters are initialised at 0
	// (knowPool, knowScaled).
	pools, scaled map[string]bool
}

func newOps() ops {
	return ops{queued: map[poolReason]int{}, requeues: map[poolReason]uint64{}, moves: map[moveKey]uint64{},
		scale: map[poolKind]uint64{}, machines: map[poolKind]uint64{}, decisions: map[string]bool{}, machineIDs: map[string]bool{},
		pools: map[string]bool{}, scaled: map[string]bool{}}
}

// The label values a counter series is initialised with at 0. A counter
// whose series first appears at 1 hides its first event from increase()
// and rate(): Prometheus has no earlier sample to subtract from, so after
// two requeues a panel of increase(...[5m]) read 0. Each list names every
// value the platform can count today.
var (
	// RequeueReasons are the reasons the scheduler requeues a job with
	// (contracts.EventRequeued): a lost allocation, a stop to make room or
	// to move it, a gang committed in part, a reservation's run-time
	// promise broken.
	RequeueReasons = []contracts.Reason{contracts.ReasonNodeLost, contracts.ReasonPreempted, contracts.ReasonGangIncomplete,
		contracts.ReasonRunTimeExceeded, contracts.ReasonDrained, contracts.ReasonGPUUnhealthy, contracts.ReasonSpotInterruption,
		contracts.ReasonOverheating, contracts.ReasonDefragment}
	// MoveReasons are the reasons a job migrates with (contracts.Migration).
	MoveReasons = []contracts.Reason{contracts.ReasonDrained, contracts.ReasonGPUUnhealthy, contracts.ReasonSpotInterruption,
		contracts.ReasonOverheating, contracts.ReasonDefragment}
	// MoveEvents are the two events of a move.
	MoveEvents = []contracts.JobEventType{contracts.EventMigrating, contracts.EventMigrated}
	// ScaleDirections are the directions of contracts.ScaleDecision.
	ScaleDirections = []contracts.ScaleDirection{contracts.ScaleUp, contracts.ScaleDown}
	// MachineEventKinds are the kinds of contracts.MachineEvent.
	MachineEventKinds = []contracts.MachineEventKind{contracts.MachineRequested, contracts.MachineReady, contracts.MachineDraining,
		contracts.MachineDeleted, contracts.MachineInterrupted, contracts.MachineReclaimed, contracts.MachineFailed}
)

// knowPool initialises the job counters of pool at 0 (once): requeues and
// moves by every reason. A pool is known from the first inventory, node
// event or demand that names it, before any job can have run there.
func (o *ops) knowPool(pool string) {
	if pool == "" || o.pools[pool] {
		return
	}
	o.pools[pool] = true
	for _, r := range RequeueReasons {
		o.requeues[poolReason{pool, string(r)}] += 0
	}
	for _, r := range MoveReasons {
		for _, ev := range MoveEvents {
			o.moves[moveKey{pool, string(r), ev}] += 0
		}
	}
}

// knowScaled initialises the autoscaler's counters of pool at 0 (once):
// decisions by direction and machine events by kind. Only a pool the
// autoscaler acts on has them: it is known from its first machine event
// (the refill to its minimum at start) or decision. A pool whose first
// fact is a decision shows that decision at 1: nothing on the bus names
// the pools with a scaling policy before the autoscaler acts on one.
func (o *ops) knowScaled(pool string) {
	if pool == "" || o.scaled[pool] {
		return
	}
	o.scaled[pool] = true
	for _, d := range ScaleDirections {
		o.scale[poolKind{pool, string(d)}] += 0
	}
	for _, k := range MachineEventKinds {
		o.machines[poolKind{pool, string(k)}] += 0
	}
}

// applyJobEvent folds an event the state machine accepted (from j.state to
// to) into the queue and the counters.
func (o *ops) applyJobEvent(j *job, ev contracts.JobEvent, to contracts.JobState) {
	if ev.Request != nil {
		j.pool = ev.Request.Pool
	}
	if p := placedPool(ev); p != "" {
		j.placedPool = p
		o.knowPool(p)
	}
	wasQueued := j.state == contracts.StateQueued
	old := poolReason{j.pool, reasonLabel(j.reason)}
	switch {
	case ev.Type == contracts.EventPending:
		j.reason = ev.Reason
	case to == contracts.StateQueued && !wasQueued:
		j.reason = "" // requeued: why it waits now is not yet known
	}
	if wasQueued {
		o.queued[old]--
	}
	if to == contracts.StateQueued {
		o.queued[poolReason{j.pool, reasonLabel(j.reason)}]++
	}

	switch ev.Type {
	case contracts.EventRequeued:
		if o.first(j, ev.Type, ev.Attempt) {
			o.requeues[poolReason{j.placedPool, reasonLabel(ev.Reason)}]++
		}
	case contracts.EventMigrating, contracts.EventMigrated:
		if ev.Migration == nil {
			return
		}
		attempt := ev.Attempt
		if ev.Type == contracts.EventMigrating {
			attempt = max(attempt, ev.Migration.FromAttempt)
		}
		if !o.first(j, ev.Type, attempt) {
			return
		}
		pool := j.placedPool
		if len(ev.Migration.From) > 0 && ev.Migration.From[0].Pool != "" {
			pool = ev.Migration.From[0].Pool
		}
		o.moves[moveKey{pool, reasonLabel(ev.Migration.Reason), ev.Type}]++
	}
}

// first reports whether an event of typ for attempt is counted for the
// first time, and records it.
func (o *ops) first(j *job, typ contracts.JobEventType, attempt int) bool {
	if j.counted == nil {
		j.counted = map[contracts.JobEventType]int{}
	}
	if seen, ok := j.counted[typ]; ok && attempt <= seen {
		return false
	}
	j.counted[typ] = attempt
	return true
}

func placedPool(ev contracts.JobEvent) string {
	if ev.Placement != nil && ev.Placement.Pool != "" {
		return ev.Placement.Pool
	}
	if len(ev.Placements) > 0 {
		return ev.Placements[0].Pool
	}
	return ""
}

func reasonLabel(r contracts.Reason) string {
	if r == "" {
		return NoReason
	}
	return string(r)
}

// ApplyScaleDecision counts an autoscaler decision once per decision ID
// (per pool, direction and time when it has none).
func (m *Model) ApplyScaleDecision(d contracts.ScaleDecision) {
	m.mu.Lock()
	defer m.mu.Unlock()
	id := d.ID
	if id == "" {
		id = d.Pool + "/" + string(d.Direction) + "/" + d.Time.String()
	}
	if m.ops.decisions[id] {
		return
	}
	m.ops.knowScaled(d.Pool)
	m.ops.decisions[id] = true
	m.ops.scale[poolKind{d.Pool, string(d.Direction)}]++
}

// ApplyMachineEvent counts a machine event once per contracts.MachineEventID.
func (m *Model) ApplyMachineEvent(e contracts.MachineEvent) {
	m.mu.Lock()
	defer m.mu.Unlock()
	subject := e.MachineID
	if subject == "" {
		subject = e.Token
	}
	id := contracts.MachineEventID(e.Kind, subject)
	if m.ops.machineIDs[id] {
		return
	}
	m.ops.knowScaled(e.Pool)
	m.ops.knowPool(e.Pool)
	m.ops.machineIDs[id] = true
	m.ops.machines[poolKind{e.Pool, string(e.Kind)}]++
}

// QueueCount is how many queued jobs asked for a pool ("" for any) and
// wait for one reason (NoReason before the scheduler gave one).
type QueueCount struct {
	Pool   string
	Reason string
	Jobs   int
}

func (o *ops) queue() []QueueCount {
	out := make([]QueueCount, 0, len(o.queued))
	for k, n := range o.queued {
		out = append(out, QueueCount{Pool: k.pool, Reason: k.reason, Jobs: n})
	}
	slices.SortFunc(out, func(a, b QueueCount) int {
		return cmp.Or(cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.Reason, b.Reason))
	})
	return out
}

// Counters are totals since the streams began, each counted once per
// event identity.
type Counters struct {
	// Requeues by the pool the job ran on and reason (preempted,
	// node_lost, ...).
	Requeues []PoolLabelCount
	// Moves counts migrating and migrated events by pool and reason.
	Moves []MoveCount
	// ScaleDecisions by pool and direction (Label).
	ScaleDecisions []PoolLabelCount
	// MachineEvents by pool and kind (Label).
	MachineEvents []PoolLabelCount
}

// PoolLabelCount is a counter of one pool and one label value.
type PoolLabelCount struct {
	Pool  string
	Label string
	N     uint64
}

// MoveCount counts the migrating or migrated events (Event) of one pool
// and reason.
type MoveCount struct {
	Pool   string
	Reason string
	Event  contracts.JobEventType
	N      uint64
}

func (o *ops) counters() Counters {
	list := func(m map[poolKind]uint64) []PoolLabelCount {
		out := make([]PoolLabelCount, 0, len(m))
		for k, n := range m {
			out = append(out, PoolLabelCount{Pool: k.pool, Label: k.kind, N: n})
		}
		slices.SortFunc(out, func(a, b PoolLabelCount) int {
			return cmp.Or(cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.Label, b.Label))
		})
		return out
	}
	requeues := make(map[poolKind]uint64, len(o.requeues))
	for k, n := range o.requeues {
		requeues[poolKind{k.pool, k.reason}] = n
	}
	c := Counters{Requeues: list(requeues), ScaleDecisions: list(o.scale), MachineEvents: list(o.machines)}
	for k, n := range o.moves {
		c.Moves = append(c.Moves, MoveCount{Pool: k.pool, Reason: k.reason, Event: k.event, N: n})
	}
	slices.SortFunc(c.Moves, func(a, b MoveCount) int {
		return cmp.Or(cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.Reason, b.Reason), cmp.Compare(a.Event, b.Event))
	})
	return c
}

// PoolCapacity is the free capacity of a pool's live nodes, in thousandths
// of a GPU, and how much of it lies on fully idle machines.
type PoolCapacity struct {
	Pool string
	// FreeMilli is the free share of every healthy, unheld GPU of live
	// nodes: 1000 per GPU less what committed allocations hold of it. A
	// GPU of a cordoned or drained node, or one held alone
	// (contracts.NodeAdmin.Held), is not free: it takes no new work.
	FreeMilli int64
	// IdleMilli is the part of FreeMilli on idle machines: live, every GPU
	// healthy and unheld, and no allocation at all.
	IdleMilli int64
}

// Fragmentation is the share of the pool's free GPU capacity that is NOT on
// fully idle healthy machines: 1 − IdleMilli/FreeMilli, 0 when nothing is
// free. 0 means every free GPU is on an empty machine (any shape fits); 1
// means the free capacity is all scattered beside running work, where a
// whole-machine or gang job cannot use it.
func (c PoolCapacity) Fragmentation() float64 {
	if c.FreeMilli <= 0 {
		return 0
	}
	// (free − idle)/free rather than 1 − idle/free: exact for round shares.
	return float64(c.FreeMilli-c.IdleMilli) / float64(c.FreeMilli)
}

// capacity computes PoolCapacity for every pool with a live node. The
// caller holds m.mu.
func (m *Model) capacity() []PoolCapacity {
	used := map[string]map[string]int64{} // node → GPU UUID → milli held
	for _, a := range m.allocs {
		u := used[a.node]
		if u == nil {
			u = map[string]int64{}
			used[a.node] = u
		}
		for uuid, milli := range a.milli {
			u[uuid] += milli
		}
	}
	pools := map[string]*PoolCapacity{}
	for id, n := range m.nodes {
		if n.lost || n.healthy == nil {
			continue
		}
		p := pools[n.pool]
		if p == nil {
			p = &PoolCapacity{Pool: n.pool}
			pools[n.pool] = p
		}
		var free int64
		idle := len(used[id]) == 0
		admin, held := m.admin[id]
		for uuid, ok := range n.healthy {
			// A GPU an operator or the platform holds (cordon, drain, a
			// GPU hold) takes no new work, like a sick one: its free share
			// is not capacity, and its machine is not idle.
			if !ok || (held && admin.Held(uuid)) {
				idle = false
				continue
			}
			free += max(1000-used[id][uuid], 0)
		}
		p.FreeMilli += free
		if idle {
			p.IdleMilli += free
		}
	}
	out := make([]PoolCapacity, 0, len(pools))
	for _, p := range pools {
		out = append(out, *p)
	}
	slices.SortFunc(out, func(a, b PoolCapacity) int { return cmp.Compare(a.Pool, b.Pool) })
	return out
}

// deviceMilli is what an allocation holds of each GPU: all of it, a MIG
// instance's compute slices over 7, or a share's compute percentage.
func deviceMilli(devs []contracts.DeviceRef) map[string]int64 {
	out := make(map[string]int64, len(devs))
	for _, d := range devs {
		out[d.UUID] += min(d.MilliGPUs(), 1000)
	}
	return out
}

// PoolPressure is what the pool rules read of one pool: how fragmented its
// free capacity is and how many jobs wait for it.
type PoolPressure struct {
	Pool          string
	Fragmentation float64 // PoolCapacity.Fragmentation, 0 to 1
	PendingJobs   int     // the scheduler's latest PoolDemand
}

// Pressure returns PoolPressure for every pool with live nodes or demand,
// by pool.
func (m *Model) Pressure() []PoolPressure {
	m.mu.Lock()
	defer m.mu.Unlock()
	byPool := map[string]*PoolPressure{}
	for _, c := range m.capacity() {
		byPool[c.Pool] = &PoolPressure{Pool: c.Pool, Fragmentation: c.Fragmentation()}
	}
	for pool, d := range m.demand {
		p := byPool[pool]
		if p == nil {
			p = &PoolPressure{Pool: pool}
			byPool[pool] = p
		}
		p.PendingJobs = d.PendingJobs
	}
	out := make([]PoolPressure, 0, len(byPool))
	for _, p := range byPool {
		out = append(out, *p)
	}
	slices.SortFunc(out, func(a, b PoolPressure) int { return cmp.Compare(a.Pool, b.Pool) })
	return out
}
