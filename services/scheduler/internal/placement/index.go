package placement

import (
	"cmp"
	"encoding/binary"
	"math/bits"
	"slices"
	"strconv"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/fragsim"
)

// Placer places requests one at a time on a snapshot, taking the devices
// (and host CPU and memory) it hands out for the rest of the cycle, so
// nothing is given twice. It is not safe for concurrent use.
type Placer struct {
	opt   Options
	nodes []nodeState // by ord: node ID ascending
	arena []slot      // every node's slots, one backing array

	pools, zones names
	poolPolicy   []policy // by pool id
	poolNodes    []int    // nodes per pool id
	taintSigs    [][]contracts.Taint
	models       names // GPU model names by model id
	profiles     names // MIG profile names by id
	kinds        []kind
	kindIndex    map[kindKey]int32
	kindReps     []*GPU // a card of each kind, while there are few kinds

	classes []class
	// initMembers are the members of each class present when the cycle
	// started, as they were then.
	initMembers [][]int32
	classHash   map[uint64]int32       // first class of each hash; class.next chains
	fragViews   map[uint64][]*fragView // by hashView(view, pool): see fragViewFor
	// live lists classes in the order they gained their first member
	// (created or emptied and refilled); shape lists catch up from it.
	live []int32
	// occupied are the classes with members, in no particular order
	// (occupiedAt: each class's position there, -1 when empty): a cycle
	// leaves thousands of emptied classes behind that explain skips.
	occupied, occupiedAt []int32

	shapes map[string]*shape
	keyBuf []byte
	msgBuf []byte // withQueue's
	// id names the Placer for RequestMemo; reqMemo is the memo of the
	// request being placed (PlaceMemo), nil for none.
	id      uint64
	reqMemo *RequestMemo
	// shapeList holds the shapes by index (shape.index).
	shapeList []*shape
	// prefixes interns RequestMemo prefixes.
	prefixes map[string]string
	scratch  []slot
	scratch2 []slot
	runs     [][2]int
	version  int // node changes so far
	placed   int // requests placed so far
	// readPlaced is set when explain read placed (an explanation that
	// names the jobs placed ahead changes with it).
	readPlaced bool
	// behindHead and behindTail are the text around the count of jobs
	// placed ahead in the explanation just made, when it names them.
	behindHead, behindTail string
	// nodeGroup is each node's group (groupNodes), groupVer how many
	// times a node of each group moved: a pending message is cached until
	// a node of a group relevant to its shape moves.
	nodeGroup   []int32
	groupVer    []int
	groupPool   []int32
	groupModels [][]int32
	memo        map[string]*memoEntry
	// failedKeys are the memo keys of requests that failed this cycle
	// (failedBefore); failedPrefix their prefixes, a first test that asks
	// no pool verdict.
	failedKeys, failedPrefix map[string]struct{}
	// noFailMemo turns failedBefore and initiallyFitMemo off (tests
	// compare both paths);
	// skipped counts the searches it saved.
	noFailMemo bool
	skipped    int
	// explaining is the memo key of the request explainMemo is
	// explaining ("" for none); initFit remembers initiallyFit by it.
	explaining string
	// keyReady says p.keyBuf holds the memo key (prefix keyPrefix bytes
	// long) of the request failedBefore just found failed.
	keyReady  bool
	keyPrefix int
	keyShape  *shape
	initFit   map[string]bool
	hostCap   map[int32][2]int64 // hostMax, by pool id (-1: all)

	// per-request state
	gen    uint64
	poolAt []uint64 // generation poolOK was asked for, by pool id
	poolIs []bool
	runsAt []uint64 // generation poolRuns was asked for, by pool id
	runsIs []bool

	frag      []*fragsim.FragAware // by pool id, built on first use
	fragModel *fragsim.Models
	pods      []fragsim.Pod
}

// names interns strings to small ids in order of first appearance.
type names struct {
	list  []string
	index map[string]int32
}

func (n *names) id(s string) int32 {
	if len(n.list) <= 8 {
		for i, x := range n.list { // few pools and zones: cheaper than hashing
			if x == s {
				return int32(i)
			}
		}
	}
	if n.index == nil {
		n.index = map[string]int32{}
	}
	if i, ok := n.index[s]; ok {
		return i
	}
	i := int32(len(n.list))
	n.list = append(n.list, s)
	n.index[s] = i
	return i
}

func (n *names) lookup(s string) (int32, bool) {
	i, ok := n.index[s]
	return i, ok
}

// kind is a static GPU type: cards of one kind are interchangeable.
type kind struct {
	model  int32
	memMiB int64
	mig    bool
	inst   []instInfo // MIG instances, as the node lists them (at most 64)
	// groups are masks of the instance slots with equal profile and
	// memory: which of them is free does not matter, only how many.
	groups []uint64
	all    uint64 // every usable instance slot
	units  int64  // capacity in milli-GPU (binpack and spread)
}

type instInfo struct {
	profile int32
	memMiB  int64
	start   int
	units   int64
}

type kindKey struct {
	model string
	mem   int64
	mig   bool
	inst  string // MIG instance layout
}

// slot is one GPU in a view: a node's (by Index) or a class's canonical one.
type slot struct {
	kind    int32
	domain  int16 // NVLink domain ordinal within the view; -1: PCIe only
	held    bool
	pct     int32  // compute percent held by shares
	mem     int64  // framebuffer held by shares
	migFree uint64 // free MIG instance slots
}

func (s *slot) whole() bool { return !s.held && s.pct == 0 && s.mem == 0 }

type nodeState struct {
	src      *Node
	pos      []int32 // src.GPUs position of each slot; nil: the same order
	slots    []slot
	cpu, mem int64
	pool     int32
	zone     int32
	taints   int32
	class    int32
}

// class is every node whose free state is the same up to a permutation of
// interchangeable GPUs: they fit and score alike for every request shape.
type class struct {
	pool, zone, taints int32
	cordoned           bool
	view               []slot // canonical
	members            []int32
	// maxCPU and maxMem bound the members' free host capacity from above
	// (members only lose capacity or leave), to skip a class cheaply.
	maxCPU, maxMem int64
	units, free    int64 // milli-GPU capacity and free, for binpack/spread
	// wholeN, roomMax and migN summarise the view (free whole cards, most
	// compute percent free on a card that takes shares, free MIG
	// instances) so a shape rejects most classes without a walk.
	wholeN, roomMax, migN int
	hash                  uint64
	next                  int32
	// frag is fragaware's model of the view, shared by the classes of one
	// pool that differ only in zone or taints (they score alike).
	frag *fragView
}

// NewPlacer indexes snap for one cycle. The snapshot is not modified and
// must not be modified while the Placer is in use. Nodes may come in any
// order (ties go to the lowest node ID); a node ID listed twice counts once,
// by its first entry.
func NewPlacer(snap Snapshot, opt Options) *Placer {
	p := &Placer{
		opt:          opt,
		kindIndex:    map[kindKey]int32{},
		classHash:    make(map[uint64]int32, 256),
		fragViews:    make(map[uint64][]*fragView, 256),
		classes:      make([]class, 0, 256),
		shapes:       map[string]*shape{},
		memo:         map[string]*memoEntry{},
		failedKeys:   map[string]struct{}{},
		failedPrefix: map[string]struct{}{},
		initFit:      map[string]bool{},
		noFailMemo:   opt.Exhaustive,
		id:           placerIDs.Add(1),
	}
	src := make([]*Node, len(snap.Nodes))
	for i := range snap.Nodes {
		src[i] = &snap.Nodes[i]
	}
	if !slices.IsSortedFunc(src, func(a, b *Node) int { return cmp.Compare(a.ID, b.ID) }) {
		slices.SortStableFunc(src, byID)
	}
	// A node listed twice is one machine: its first entry counts.
	src = slices.CompactFunc(src, func(a, b *Node) bool { return a.ID == b.ID })
	total := 0
	for _, n := range src {
		total += len(n.GPUs)
	}
	p.arena = make([]slot, total)
	p.nodes = make([]nodeState, len(src))
	var taints []contracts.Taint
	taintSig := int32(0)
	p.taintSigs = [][]contracts.Taint{nil}
	var domains []string
	prev := -1 // kind of the previous GPU, to skip the map for runs of equal cards
	var prevGPU *GPU
	off := 0
	for ord, n := range src {
		ns := &p.nodes[ord]
		ns.src = n
		ns.cpu, ns.mem = n.CPUMilliFree, n.MemoryMiBFree
		ns.pool = p.pools.id(n.Pool)
		ns.zone = p.zones.id(n.Zone)
		if len(n.Taints) == 0 {
			ns.taints = 0
		} else {
			if !slices.Equal(n.Taints, taints) {
				taints, taintSig = n.Taints, p.taintSig(n.Taints)
			}
			ns.taints = taintSig
		}
		if int(ns.pool) == len(p.poolNodes) {
			p.poolNodes = append(p.poolNodes, 0)
		}
		p.poolNodes[ns.pool]++
		ns.slots = p.arena[off : off+len(n.GPUs) : off+len(n.GPUs)]
		off += len(n.GPUs)
		if !gpusSorted(n.GPUs) {
			ns.pos = make([]int32, len(n.GPUs))
			for i := range ns.pos {
				ns.pos[i] = int32(i)
			}
			slices.SortStableFunc(ns.pos, func(a, b int32) int { return cmp.Compare(n.GPUs[a].Index, n.GPUs[b].Index) })
		}
		domains = domains[:0]
		for i := range ns.slots {
			g := &n.GPUs[ns.gpu(i)]
			if prevGPU == nil || !sameKind(prevGPU, g) {
				prev = int(p.kindOf(g))
			}
			prevGPU = g
			s := slot{kind: int32(prev), domain: -1, held: g.Held, pct: int32(max(-1000, min(g.SharePercent, 1000))), mem: g.ShareMemMiB}
			if g.NVLinkDomain != "" {
				d := slices.Index(domains, g.NVLinkDomain)
				if d < 0 {
					d = len(domains)
					domains = append(domains, g.NVLinkDomain)
				}
				s.domain = int16(min(d, 1<<14))
			}
			if g.MIG {
				k := &p.kinds[prev]
				for j := range g.Instances {
					if j < 64 && !g.Instances[j].Held {
						s.migFree |= 1 << j
					}
				}
				s.migFree &= k.all
			}
			ns.slots[i] = s
		}
		if ord > 0 && prevSame(&p.nodes[ord-1], ns, src[ord-1].Cordoned, n.Cordoned) {
			ns.class = p.nodes[ord-1].class // idle and full machines of a pool come in runs
		} else {
			ns.class = p.classFor(ns, n.Cordoned)
		}
		c := &p.classes[ns.class]
		c.members = append(c.members, int32(ord))
		c.maxCPU, c.maxMem = max(c.maxCPU, ns.cpu), max(c.maxMem, ns.mem)
	}
	p.initMembers = make([][]int32, len(p.classes))
	all := make([]int32, 0, len(p.nodes))
	for i := range p.classes {
		start := len(all)
		all = append(all, p.classes[i].members...)
		p.initMembers[i] = all[start:len(all):len(all)]
	}
	p.groupNodes()
	p.live = make([]int32, len(p.classes))
	p.occupied = make([]int32, len(p.classes))
	p.occupiedAt = make([]int32, len(p.classes))
	for i := range p.live {
		p.live[i] = int32(i)
		p.occupied[i], p.occupiedAt[i] = int32(i), int32(i)
	}
	p.poolPolicy = make([]policy, len(p.pools.list))
	for i, name := range p.pools.list {
		p.poolPolicy[i] = policyOf(opt, name)
	}
	p.poolAt = make([]uint64, len(p.pools.list))
	p.poolIs = make([]bool, len(p.pools.list))
	p.runsAt = make([]uint64, len(p.pools.list))
	p.runsIs = make([]bool, len(p.pools.list))
	p.frag = make([]*fragsim.FragAware, len(p.pools.list))
	return p
}

func byID(a, b *Node) int { return cmp.Compare(a.ID, b.ID) }

// prevSame reports whether two nodes are in the same state slot by slot.
func prevSame(a, b *nodeState, ac, bc bool) bool {
	return a.pool == b.pool && a.zone == b.zone && a.taints == b.taints && ac == bc && slices.Equal(a.slots, b.slots)
}

func gpusSorted(g []GPU) bool {
	for i := 1; i < len(g); i++ {
		if g[i].Index < g[i-1].Index {
			return false
		}
	}
	return true
}

// gpu is the src.GPUs position of slot i.
func (n *nodeState) gpu(i int) int {
	if n.pos == nil {
		return i
	}
	return int(n.pos[i])
}

func (p *Placer) taintSig(t []contracts.Taint) int32 {
	for i, s := range p.taintSigs {
		if i > 0 && slices.Equal(s, t) {
			return int32(i)
		}
	}
	p.taintSigs = append(p.taintSigs, t)
	return int32(len(p.taintSigs) - 1)
}

// sameKind reports whether two cards are of one kind (cheaply, for runs).
func sameKind(a, b *GPU) bool {
	if a.Model != b.Model || a.MemoryMiB != b.MemoryMiB || a.MIG != b.MIG || len(a.Instances) != len(b.Instances) {
		return false
	}
	if !a.MIG {
		return true
	}
	for i := range a.Instances {
		x, y := &a.Instances[i].Instance, &b.Instances[i].Instance
		if x.Profile != y.Profile || x.MemoryMiB != y.MemoryMiB || x.Start != y.Start {
			return false
		}
	}
	return true
}

func (p *Placer) kindOf(g *GPU) int32 {
	if len(p.kindReps) == len(p.kinds) {
		for id, rep := range p.kindReps {
			if sameKind(rep, g) {
				return int32(id)
			}
		}
	}
	k := kindKey{model: g.Model, mem: g.MemoryMiB, mig: g.MIG}
	if g.MIG {
		var b []byte
		for _, in := range g.Instances {
			b = append(b, in.Instance.Profile...)
			b = append(b, 0)
			b = strconv.AppendInt(b, in.Instance.MemoryMiB, 10)
			b = append(b, 0)
			b = strconv.AppendInt(b, int64(in.Instance.Start), 10)
			b = append(b, 0)
		}
		k.inst = string(b)
	}
	if id, ok := p.kindIndex[k]; ok {
		return id
	}
	kd := kind{model: p.models.id(g.Model), memMiB: g.MemoryMiB, mig: g.MIG, units: 1000}
	if g.MIG {
		kd.units = 0
		for j, in := range g.Instances {
			if j >= 64 {
				break // more than any GPU has; the rest are never offered
			}
			u := migUnits(in.Instance.Profile)
			kd.inst = append(kd.inst, instInfo{profile: p.profiles.id(in.Instance.Profile), memMiB: in.Instance.MemoryMiB,
				start: in.Instance.Start, units: u})
			kd.all |= 1 << j
			kd.units += u
		}
		for j := range kd.inst {
			grouped := false
			for gi, m := range kd.groups {
				f := bits.TrailingZeros64(m)
				if kd.inst[f].profile == kd.inst[j].profile && kd.inst[f].memMiB == kd.inst[j].memMiB {
					kd.groups[gi] |= 1 << j
					grouped = true
					break
				}
			}
			if !grouped {
				kd.groups = append(kd.groups, 1<<j)
			}
		}
	}
	id := int32(len(p.kinds))
	p.kinds = append(p.kinds, kd)
	p.kindIndex[k] = id
	if len(p.kindReps) == len(p.kinds)-1 && len(p.kindReps) < 16 {
		p.kindReps = append(p.kindReps, g)
	}
	return id
}

// migUnits is a MIG profile's compute in milli-GPU: its compute slices
// over 7, as quotas count it.
func migUnits(profile string) int64 {
	return contracts.GPURequest{Count: 1, MIGProfile: profile}.MilliGPUs()
}

// classFor returns the class of n's current state, creating it if new.
func (p *Placer) classFor(n *nodeState, cordoned bool) int32 {
	view := p.canonical(n.slots)
	h := hashView(view, n.pool, n.zone, n.taints, cordoned)
	first, ok := p.classHash[h]
	if ok {
		for c := first; c >= 0; c = p.classes[c].next {
			cl := &p.classes[c]
			if cl.pool == n.pool && cl.zone == n.zone && cl.taints == n.taints && cl.cordoned == cordoned && slices.Equal(cl.view, view) {
				return c
			}
		}
	}
	id := int32(len(p.classes))
	cl := class{pool: n.pool, zone: n.zone, taints: n.taints, cordoned: cordoned, view: slices.Clone(view), hash: h, next: -1}
	for i := range cl.view {
		s := &cl.view[i]
		k := &p.kinds[s.kind]
		cl.units += k.units
		switch {
		case s.held:
		case k.mig:
			cl.migN += bits.OnesCount64(s.migFree)
			for j := range k.inst {
				if s.migFree&(1<<j) != 0 {
					cl.free += k.inst[j].units
				}
			}
		default:
			cl.free += max(0, 1000-10*int64(s.pct))
			cl.roomMax = max(cl.roomMax, 100-int(s.pct))
			if s.whole() {
				cl.wholeN++
			}
		}
	}
	if ok {
		cl.next = p.classes[first].next
		p.classes[first].next = id
	} else {
		p.classHash[h] = id
	}
	cl.frag = p.fragViewFor(cl.view, n.pool)
	p.classes = append(p.classes, cl)
	return id
}

// fragViewFor returns the fragView shared by every class of pool with view.
func (p *Placer) fragViewFor(view []slot, pool int32) *fragView {
	h := hashView(view, pool, 0, 0, false)
	for _, fv := range p.fragViews[h] {
		if fv.pool == pool && slices.Equal(fv.view, view) {
			return fv
		}
	}
	fv := &fragView{pool: pool, view: slices.Clone(view)}
	p.fragViews[h] = append(p.fragViews[h], fv)
	return fv
}

// canonical is slots in a form equal for every permutation of
// interchangeable cards: MIG masks reduced to counts per profile, GPUs
// sorted within each NVLink domain, domains (and PCIe cards) sorted, and
// domains renumbered in that order. It returns p.scratch.
func (p *Placer) canonical(slots []slot) []slot {
	buf := append(p.scratch[:0], slots...)
	p.scratch = buf
	for i := range buf {
		s := &buf[i]
		if s.held {
			*s = slot{kind: s.kind, domain: s.domain, held: true}
			continue
		}
		if k := &p.kinds[s.kind]; k.mig && len(k.groups) > 0 {
			var m uint64
			for _, g := range k.groups {
				n := bits.OnesCount64(s.migFree & g)
				for b := g; n > 0; n-- {
					low := b & -b
					m |= low
					b &^= low
				}
			}
			s.migFree = m
		}
	}
	// Sort by domain (PCIe cards last), then state: each domain is a run.
	sortSlots(buf, true)
	nvl := 0
	for nvl < len(buf) && buf[nvl].domain >= 0 {
		nvl++
	}
	if nvl == 0 {
		return buf
	}
	if buf[0].domain == buf[nvl-1].domain { // one domain: the common case
		for i := range nvl {
			buf[i].domain = 0
		}
		return buf
	}
	// Several domains: order the runs by size, then content; renumber.
	runs := p.runs[:0]
	for i := 0; i < nvl; {
		j := i + 1
		for j < nvl && buf[j].domain == buf[i].domain {
			j++
		}
		runs = append(runs, [2]int{i, j})
		i = j
	}
	p.runs = runs
	for i := 1; i < len(runs); i++ {
		for j := i; j > 0 && runLess(buf, runs[j], runs[j-1]); j-- {
			runs[j], runs[j-1] = runs[j-1], runs[j]
		}
	}
	out := append(p.scratch2[:0], buf[:nvl]...)
	p.scratch2 = out
	pos := 0
	for d, r := range runs {
		for i := r[0]; i < r[1]; i++ {
			buf[pos] = out[i]
			buf[pos].domain = int16(d)
			pos++
		}
	}
	return buf
}

// sortSlots sorts by (domain, PCIe last, when byDomain) then state.
func sortSlots(v []slot, byDomain bool) {
	less := func(a, b *slot) bool {
		if byDomain && a.domain != b.domain {
			if a.domain < 0 || b.domain < 0 {
				return b.domain < 0
			}
			return a.domain < b.domain
		}
		return slotLess(a, b)
	}
	if len(v) > 32 {
		slices.SortFunc(v, func(a, b slot) int {
			switch {
			case less(&a, &b):
				return -1
			case less(&b, &a):
				return 1
			}
			return 0
		})
		return
	}
	for i := 1; i < len(v); i++ {
		for j := i; j > 0 && less(&v[j], &v[j-1]); j-- {
			v[j], v[j-1] = v[j-1], v[j]
		}
	}
}

func slotLess(a, b *slot) bool {
	switch {
	case a.kind != b.kind:
		return a.kind < b.kind
	case a.held != b.held:
		return !a.held
	case a.pct != b.pct:
		return a.pct < b.pct
	case a.mem != b.mem:
		return a.mem < b.mem
	}
	return a.migFree < b.migFree
}

// runLess orders two domain runs of buf: smaller first, then by content.
func runLess(buf []slot, a, b [2]int) bool {
	if la, lb := a[1]-a[0], b[1]-b[0]; la != lb {
		return la < lb
	}
	for i := range a[1] - a[0] {
		x, y := &buf[a[0]+i], &buf[b[0]+i]
		if slotLess(x, y) {
			return true
		}
		if slotLess(y, x) {
			return false
		}
	}
	return false
}

func hashView(view []slot, pool, zone, taints int32, cordoned bool) uint64 {
	const prime = 1099511628211
	h := uint64(14695981039346656037)
	mix := func(v uint64) { h = (h ^ v) * prime }
	mix(uint64(pool))
	mix(uint64(zone))
	mix(uint64(taints))
	if cordoned {
		mix(1)
	}
	for i := range view {
		s := &view[i]
		mix(uint64(s.kind)<<16 | uint64(uint16(s.domain)))
		v := uint64(uint32(s.pct))
		if s.held {
			v |= 1 << 40
		}
		mix(v)
		mix(uint64(s.mem))
		mix(s.migFree)
	}
	return h
}

// move puts node ord in the class of its current state.
func (p *Placer) move(ord int32) {
	n := &p.nodes[ord]
	old := &p.classes[n.class]
	if i, ok := slices.BinarySearch(old.members, ord); ok {
		old.members = slices.Delete(old.members, i, i+1)
	}
	if len(old.members) == 0 {
		p.vacate(n.class)
	}
	id := p.classFor(n, false)
	c := &p.classes[id]
	i, _ := slices.BinarySearch(c.members, ord)
	c.members = slices.Insert(c.members, i, ord)
	c.maxCPU, c.maxMem = max(c.maxCPU, n.cpu), max(c.maxMem, n.mem)
	if len(c.members) == 1 {
		p.live = append(p.live, id)
		p.occupy(id)
	}
	n.class = id
	p.version++
	p.groupVer[p.nodeGroup[ord]]++
}

// groupNodes puts every node in the group of its pool and the GPU models
// it has (both static): a node's move changes the explanations of the
// shapes that may use one of those models in that pool only (relevant).
func (p *Placer) groupNodes() {
	p.nodeGroup = make([]int32, len(p.nodes))
	index := map[string]int32{}
	var key []byte
	var models []int32
	for cid := range p.initMembers {
		if len(p.initMembers[cid]) == 0 {
			continue
		}
		c := &p.classes[cid]
		models = models[:0]
		for _, sl := range c.view {
			if m := p.kinds[sl.kind].model; !slices.Contains(models, m) {
				models = append(models, m)
			}
		}
		slices.Sort(models)
		key = binary.AppendVarint(key[:0], int64(c.pool))
		for _, m := range models {
			key = binary.AppendVarint(key, int64(m))
		}
		g, ok := index[string(key)]
		if !ok {
			g = int32(len(p.groupVer))
			index[string(key)] = g
			p.groupVer = append(p.groupVer, 0)
			p.groupPool = append(p.groupPool, c.pool)
			p.groupModels = append(p.groupModels, slices.Clone(models))
		}
		for _, ord := range p.initMembers[cid] {
			p.nodeGroup[ord] = g
		}
	}
}

// relevant lists the node groups whose nodes' moves may change an
// explanation of shape s: those in s's pool with a model s allows (explain
// skips every class without the hardware, and a class of a model s does
// not allow has none).
func (p *Placer) relevant(s *shape) []int32 {
	if s.groupsOK {
		return s.groups
	}
	for g, pool := range p.groupPool {
		if s.pool >= 0 && pool != s.pool {
			continue
		}
		if s.allowed == nil || slices.ContainsFunc(p.groupModels[g], func(m int32) bool { return s.allowed[m] }) {
			s.groups = append(s.groups, int32(g))
		}
	}
	s.groupsOK = true
	return s.groups
}

// stamp sums the versions of s's relevant groups: versions only grow, so
// the sum is the same exactly when no relevant node moved.
func (p *Placer) stamp(s *shape) int {
	n := 0
	for _, g := range p.relevant(s) {
		n += p.groupVer[g]
	}
	return n
}

// occupy adds class id, which just gained its first member, to the
// classes with members.
func (p *Placer) occupy(id int32) {
	for len(p.occupiedAt) <= int(id) {
		p.occupiedAt = append(p.occupiedAt, -1)
	}
	if p.occupiedAt[id] < 0 {
		p.occupiedAt[id] = int32(len(p.occupied))
		p.occupied = append(p.occupied, id)
	}
}

// vacate removes class id, which just lost its last member, from the
// classes with members (in any order: their users sum and take maxima).
func (p *Placer) vacate(id int32) {
	if int(id) >= len(p.occupiedAt) || p.occupiedAt[id] < 0 {
		return
	}
	i := p.occupiedAt[id]
	last := p.occupied[len(p.occupied)-1]
	p.occupied[i], p.occupiedAt[last] = last, i
	p.occupied = p.occupied[:len(p.occupied)-1]
	p.occupiedAt[id] = -1
}
