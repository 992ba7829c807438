package placement

import (
	"cmp"
	"slices"
	"strconv"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/fragsim"
)

// shape is what a request asks of one machine's GPUs, without the per-node
// parts (host CPU and memory, selector, reservations, quota). Requests of
// one shape fit and rank the classes alike, so the ranking is kept for the
// cycle and only new or refilled classes are scored as they appear.
type shape struct {
	key      string
	index    int32 // in Placer.shapeList
	kind     contracts.GPUKind
	k        int    // whole cards per machine
	allowed  []bool // by model id; nil: any model
	none     bool   // fits nowhere: an unknown pool, model or MIG profile
	minMem   int64
	profile  int32
	shareMem int64
	sharePct int32
	nvlink   bool
	pool     int32 // -1: any pool
	tol      []contracts.Toleration
	tier     []int8 // by taint signature: 0 fine, 1 last resort, 2 refused; -1 not known yet
	units    int64  // milli-GPU per machine, for binpack and spread
	fs       fragsim.Request

	facts []*classFacts // by class id, for pending messages
	// groups are the node groups relevant to its explanations, once
	// groupsOK (Placer.relevant).
	groups   []int32
	groupsOK bool

	lists  [numPolicies][]entry // ranked classes of the pools of each policy
	inList []bool               // by class id
	cursor int                  // how much of Placer.live the lists include
}

// entry is one class in a shape's ranking: by tier, then score.
type entry struct {
	score float64
	tier  int8
	class int32
}

func entryCmp(a, b entry) int {
	switch {
	case a.tier != b.tier:
		return int(a.tier) - int(b.tier)
	case a.score > b.score:
		return -1
	case a.score < b.score:
		return 1
	}
	return int(a.class - b.class)
}

// mayFit rejects, from the class summary, most classes s cannot fit.
func (s *shape) mayFit(c *class) bool {
	switch s.kind {
	case contracts.GPUKindMIG:
		return c.migN > 0
	case contracts.GPUKindShare:
		return c.roomMax >= int(s.sharePct)
	}
	return c.wholeN >= s.k
}

func (s *shape) allows(model int32) bool { return s.allowed == nil || s.allowed[model] }

// shapeFor returns the shape of r's machines; model >= 0 restricts it to
// one model (a gang's machines share one).
func (p *Placer) shapeFor(r *Request, model int32) *shape {
	g := &r.GPU
	b := append(p.keyBuf[:0], byte(g.Kind()[0]))
	b = strconv.AppendInt(b, int64(g.Count/g.Machines()), 10)
	b = append(b, '|')
	if model >= 0 {
		b = append(b, '#')
		b = strconv.AppendInt(b, int64(model), 10)
	} else {
		for _, m := range g.AllowedModels() {
			b = append(b, m...)
			b = append(b, 0)
		}
	}
	b = append(b, '|')
	b = strconv.AppendInt(b, g.MemoryMiB, 10)
	b = append(b, '|')
	b = append(b, g.MIGProfile...)
	if g.Share != nil {
		b = append(b, '|')
		b = strconv.AppendInt(b, g.Share.MemoryMiB, 10)
		b = append(b, '|')
		b = strconv.AppendInt(b, int64(g.Share.ComputePercent), 10)
	}
	b = append(b, '|')
	b = append(b, g.Topology...)
	b = append(b, '|')
	b = append(b, r.Pool...)
	for _, t := range r.Tolerations {
		b = append(b, 0)
		b = append(b, t.Key...)
		b = append(b, 1)
		b = append(b, t.Operator...)
		b = append(b, 1)
		b = append(b, t.Value...)
		b = append(b, 1)
		b = append(b, t.Effect...)
	}
	p.keyBuf = b
	if s, ok := p.shapes[string(b)]; ok {
		return s
	}
	s := &shape{key: string(b), kind: g.Kind(), k: g.Count / g.Machines(), minMem: g.MemoryMiB, profile: -1,
		nvlink: g.Topology == contracts.TopologyNVLink, pool: -1, tol: slices.Clone(r.Tolerations)}
	switch {
	case model >= 0:
		s.allowed = make([]bool, len(p.models.list))
		s.allowed[model] = true
	case g.AllowedModels() != nil:
		s.allowed = make([]bool, len(p.models.list))
		s.none = true
		for _, m := range g.AllowedModels() {
			if id, ok := p.models.lookup(m); ok {
				s.allowed[id] = true
				s.none = false
			}
		}
	}
	if r.Pool != "" {
		if id, ok := p.pools.lookup(r.Pool); ok {
			s.pool = id
		} else {
			s.pool, s.none = -2, true // no class has pool -2
		}
	}
	switch s.kind {
	case contracts.GPUKindMIG:
		if id, ok := p.profiles.lookup(g.MIGProfile); ok {
			s.profile = id
		} else {
			s.none = true // profile -1 matches no instance
		}
		s.units = migUnits(g.MIGProfile)
	case contracts.GPUKindShare:
		s.shareMem, s.sharePct = g.Share.MemoryMiB, int32(g.Share.ComputePercent)
		s.units = int64(g.Share.ComputePercent) * 10
		s.fs = fragsim.Request{GPUs: 1, GPUMilli: shareMilli(g.Share.ComputePercent), Models: fragsim.AnyModel}
	default:
		s.units = int64(s.k) * 1000
		s.fs = fragsim.Request{GPUs: s.k, GPUMilli: fragsim.MilliGPU, Models: fragsim.AnyModel}
	}
	s.index = int32(len(p.shapeList))
	p.shapeList = append(p.shapeList, s)
	p.shapes[s.key] = s
	return s
}

// tierOf says how s may use nodes with taint signature sig: 0 freely, 1
// as a last resort (an untolerated PreferNoSchedule taint), 2 not at all.
func (p *Placer) tierOf(s *shape, sig int32) int8 {
	if sig == 0 {
		return 0
	}
	for len(s.tier) < len(p.taintSigs) {
		s.tier = append(s.tier, -1)
	}
	if t := s.tier[sig]; t >= 0 {
		return t
	}
	t := int8(0)
	taints := p.taintSigs[sig]
	switch {
	case !contracts.Tolerated(s.tol, taints, contracts.TaintNoSchedule):
		t = 2
	case !contracts.Tolerated(s.tol, taints, contracts.TaintPreferNoSchedule):
		t = 1
	}
	s.tier[sig] = t
	return t
}

// refresh adds to s's rankings the classes that gained members since it
// last looked.
func (p *Placer) refresh(s *shape) {
	if s.none || s.cursor == len(p.live) {
		s.cursor = len(p.live)
		return
	}
	for len(s.inList) < len(p.classes) {
		s.inList = append(s.inList, false)
	}
	bulk := len(p.live)-s.cursor > 32
	var touched [numPolicies]bool
	for _, cid := range p.live[s.cursor:] {
		c := &p.classes[cid]
		if s.inList[cid] || len(c.members) == 0 || c.cordoned || (s.pool >= 0 && c.pool != s.pool) {
			continue
		}
		if !s.mayFit(c) {
			continue
		}
		tier := p.tierOf(s, c.taints)
		if tier > 1 {
			continue
		}
		sc, ok := p.score(s, cid)
		if !ok {
			continue
		}
		e := entry{score: sc, tier: tier, class: cid}
		pol := p.poolPolicy[c.pool]
		s.inList[cid] = true
		if bulk {
			s.lists[pol] = append(s.lists[pol], e)
			touched[pol] = true
			continue
		}
		i, _ := slices.BinarySearchFunc(s.lists[pol], e, entryCmp)
		s.lists[pol] = slices.Insert(s.lists[pol], i, e)
	}
	for pol, t := range touched {
		if t {
			slices.SortFunc(s.lists[pol], entryCmp)
		}
	}
	s.cursor = len(p.live)
}

// poolRuns asks r.PoolRuns about a pool, once per request.
func (p *Placer) poolRuns(r *Request, pool int32) bool {
	if r.PoolRuns == nil {
		return true
	}
	if p.runsAt[pool] != p.gen {
		p.runsAt[pool] = p.gen
		p.runsIs[pool] = r.PoolRuns(p.pools.list[pool])
	}
	return p.runsIs[pool]
}

// poolOK asks r.PoolRuns and r.AllowPool about a pool, once per request.
func (p *Placer) poolOK(r *Request, pool int32) bool {
	if !p.poolRuns(r, pool) {
		return false
	}
	if r.AllowPool == nil {
		return true
	}
	if p.poolAt[pool] != p.gen {
		p.poolAt[pool] = p.gen
		p.poolIs[pool] = r.AllowPool(p.pools.list[pool])
	}
	return p.poolIs[pool]
}

// nodeOK applies the per-node rules that classes do not capture.
func (p *Placer) nodeOK(ord int32, r *Request) bool {
	n := &p.nodes[ord]
	if n.cpu < r.CPUMilli || n.mem < r.MemoryMiB {
		return false
	}
	if r.Exclude != nil && r.Exclude[n.src.ID] {
		return false
	}
	if r.Reserved != nil {
		if _, held := r.Reserved[n.src.ID]; held {
			return false // placeHeld's, once nothing else fits
		}
	}
	return len(r.Selector) == 0 || contracts.Selected(r.Selector, n.src.Labels)
}

// firstEligible is the first member of c (below limit, when limit >= 0)
// that passes nodeOK, or -1.
func (p *Placer) firstEligible(c *class, r *Request, limit int32) int32 {
	if r.CPUMilli > c.maxCPU || r.MemoryMiB > c.maxMem {
		return -1
	}
	for _, ord := range c.members {
		if limit >= 0 && ord >= limit {
			return -1
		}
		if p.nodeOK(ord, r) {
			return ord
		}
	}
	return -1
}

// firstPreferred is the first member of c (below limit, when limit >= 0)
// that passes nodeOK and r.Prefer, or -1.
func (p *Placer) firstPreferred(c *class, r *Request, limit int32) int32 {
	if r.CPUMilli > c.maxCPU || r.MemoryMiB > c.maxMem {
		return -1
	}
	for _, ord := range c.members {
		if limit >= 0 && ord >= limit {
			return -1
		}
		if r.Prefer(p.nodes[ord].src.ID) && p.nodeOK(ord, r) {
			return ord
		}
	}
	return -1
}

// best is the first node, in node order, among the best-ranked classes of
// one policy's list of tier tier that have an eligible member; -1 if none.
// With r.Prefer, the first preferred such node instead when there is one
// (preferred says so). It drops the emptied classes it passes over.
func (p *Placer) best(s *shape, pol int, tier int8, r *Request) (best int32, preferred bool) {
	list := s.lists[pol]
	w, i := 0, 0
	found := false
	best = -1
	pref := int32(-1)
	var score float64
	for ; i < len(list); i++ {
		e := list[i]
		c := &p.classes[e.class]
		if len(c.members) == 0 {
			s.inList[e.class] = false
			continue
		}
		list[w] = e
		w++
		if e.tier < tier {
			continue
		}
		if e.tier > tier || found && e.score != score {
			i++
			break
		}
		if !p.poolOK(r, c.pool) {
			continue
		}
		if ord := p.firstEligible(c, r, best); ord >= 0 {
			found, score, best = true, e.score, ord
		}
		if r.Prefer != nil && found && e.score == score {
			if ord := p.firstPreferred(c, r, pref); ord >= 0 {
				pref = ord
			}
		}
	}
	if w < i {
		n := copy(list[w:], list[i:])
		s.lists[pol] = list[:w+n]
	}
	if pref >= 0 {
		return pref, true
	}
	return best, false
}

// searchOne is the node for a one-machine request, or -1.
func (p *Placer) searchOne(s *shape, r *Request) int32 {
	p.refresh(s)
	for tier := int8(0); tier <= 1; tier++ {
		best, bestPref := int32(-1), false
		for pol := range s.lists {
			ord, pref := p.best(s, pol, tier, r)
			if ord >= 0 && (best < 0 || pref && !bestPref || pref == bestPref && ord < best) {
				best, bestPref = ord, pref
			}
		}
		if best >= 0 {
			return best
		}
	}
	return -1
}

// searchGang picks m distinct machines for s in rank order (tier, then
// policy list, then score, then node order); with zone, the first m of one
// zone to be reached. It returns fewer than m when they do not exist.
func (p *Placer) searchGang(s *shape, r *Request, m int, zone bool) []int32 {
	p.refresh(s)
	var picked []int32
	var byZone map[int32][]int32
	if zone {
		byZone = map[int32][]int32{}
	}
	var run []int32
	for tier := int8(0); tier <= 1; tier++ {
		for pol := range s.lists {
			list := s.lists[pol]
			for i := 0; i < len(list); {
				// One run of equal rank: its members in node order.
				j := i
				run = run[:0]
				for ; j < len(list) && list[j].tier == list[i].tier && list[j].score == list[i].score; j++ {
					c := &p.classes[list[j].class]
					if list[j].tier != tier || len(c.members) == 0 || !p.poolOK(r, c.pool) ||
						r.CPUMilli > c.maxCPU || r.MemoryMiB > c.maxMem {
						continue
					}
					took := 0
					for _, ord := range c.members {
						if took == m {
							break
						}
						if p.nodeOK(ord, r) {
							run = append(run, ord)
							took++
						}
					}
				}
				slices.Sort(run)
				for _, ord := range run {
					if !zone {
						picked = append(picked, ord)
						if len(picked) == m {
							return picked
						}
						continue
					}
					z := p.nodes[ord].zone
					byZone[z] = append(byZone[z], ord)
					if len(byZone[z]) == m {
						return byZone[z]
					}
				}
				i = j
			}
		}
	}
	return picked
}

// fits reports whether s's devices can be found on node ord.
func (p *Placer) fits(ord int32, s *shape) bool {
	n := &p.nodes[ord]
	switch s.kind {
	case contracts.GPUKindMIG:
		_, _, ok := p.pickMIG(n.slots, s)
		return ok
	case contracts.GPUKindShare:
		_, ok := p.pickShare(n.slots, s)
		return ok
	}
	var buf [16]int
	_, _, ok := p.pickWhole(n.slots, s, false, buf[:0])
	return ok
}

// take gives s's devices on node ord (the pool's policy choosing among
// equal cards) to r and updates the node's class.
func (p *Placer) take(ord int32, s *shape, r *Request) (Part, bool) {
	n := &p.nodes[ord]
	pol := p.poolPolicy[n.pool]
	var devs []contracts.DeviceRef
	switch s.kind {
	case contracts.GPUKindMIG:
		pos, inst, ok := p.pickMIG(n.slots, s)
		if !ok {
			return Part{}, false
		}
		g := &n.src.GPUs[n.gpu(pos)]
		d := ref(g)
		in := g.Instances[inst].Instance
		d.MIG = &in
		devs = []contracts.DeviceRef{d}
		n.slots[pos].migFree &^= 1 << inst
	case contracts.GPUKindShare:
		pos, ok := p.pickShare(n.slots, s)
		if !ok {
			return Part{}, false
		}
		if pol == polFragAware && s.fs.Shares() {
			if fs, idx := p.fragStateOf(n.slots); fs != nil {
				if ch := p.fragPolicy(n.pool).ScoreDevices(fs, s.fs, p.shareDevices(n.slots, s, idx)); ch.GPU >= 0 {
					pos = int(idx[ch.GPU])
				}
			}
		}
		d := ref(&n.src.GPUs[n.gpu(pos)])
		d.Share = &contracts.GPUShare{MemoryMiB: s.shareMem, ComputePercent: int(s.sharePct)}
		devs = []contracts.DeviceRef{d}
		n.slots[pos].mem += s.shareMem
		n.slots[pos].pct += s.sharePct
	default:
		var buf [16]int
		picked, _, ok := p.pickWhole(n.slots, s, pol == polTopology, buf[:0])
		if !ok {
			return Part{}, false
		}
		devs = make([]contracts.DeviceRef, len(picked))
		for i, pos := range picked {
			devs[i] = ref(&n.src.GPUs[n.gpu(pos)])
			n.slots[pos].held = true
		}
	}
	n.cpu -= r.CPUMilli
	n.mem -= r.MemoryMiB
	p.move(ord)
	return Part{NodeID: n.src.ID, Pool: n.src.Pool, Zone: n.src.Zone, Devices: devs}, true
}

// Place decides one request and, when it fits, takes its devices and host
// CPU and memory for the rest of the cycle. A gang's parts are placed all
// or nothing: when not every machine is found, nothing is taken.
func (p *Placer) Place(r Request) Decision { return p.place(&r) }

// place is Place of *r: the request is ~300 bytes, copied once per call.
func (p *Placer) place(r *Request) Decision {
	if err := validate(r); err != nil {
		return Decision{Pending: Pending{Code: contracts.ReasonUnsatisfiable, Message: err.Error()}}
	}
	p.gen++
	p.keyReady = false
	if p.failedBefore(r) {
		return Decision{Pending: p.why(r)}
	}
	m := r.Machines()
	if m == 1 {
		s := p.anyShape(r)
		ord := p.searchOne(s, r)
		if ord >= 0 && p.tierOf(s, p.nodes[ord].taints) > 0 {
			// A last resort: a held node's hole without the taint first.
			if part, ok := p.placeHeld(r, true); ok {
				p.placed++
				return Decision{Parts: []Part{part}}
			}
		}
		if ord >= 0 {
			if part, ok := p.take(ord, s, r); ok {
				p.placed++
				return Decision{Parts: []Part{part}}
			}
		}
		if part, ok := p.placeHeld(r, false); ok {
			p.placed++
			return Decision{Parts: []Part{part}}
		}
		return Decision{Pending: p.why(r)}
	}
	// A gang's machines share one model: the first allowed model (in the
	// request's order, or the snapshot's for any model) that holds it all.
	models := p.gangModels(r)
	for _, model := range models {
		s := p.shapeFor(r, model)
		ords := p.searchGang(s, r, m, r.GPU.Topology == contracts.TopologyZone)
		if len(ords) < m {
			continue
		}
		// All or nothing: every machine's devices are found before any is
		// taken (the machines are distinct, so one's choice cannot change
		// another's). A member of a fitting class always fits; the check
		// keeps a bug from leaving half a gang taken.
		for _, ord := range ords {
			if !p.fits(ord, s) {
				return Decision{Pending: p.why(r)}
			}
		}
		parts := make([]Part, 0, m)
		for _, ord := range ords {
			part, _ := p.take(ord, s, r)
			parts = append(parts, part)
		}
		p.placed++
		return Decision{Parts: parts}
	}
	return Decision{Pending: p.why(r)}
}

// gangModels lists the model ids a gang may use, in preference order.
func (p *Placer) gangModels(r *Request) []int32 {
	allowed := r.GPU.AllowedModels()
	var out []int32
	if allowed == nil {
		for id := range p.models.list {
			out = append(out, int32(id))
		}
		slices.SortFunc(out, func(a, b int32) int { return cmp.Compare(p.models.list[a], p.models.list[b]) })
		return out
	}
	for _, name := range allowed {
		if id, ok := p.models.lookup(name); ok && !slices.Contains(out, id) {
			out = append(out, id)
		}
	}
	return out
}
