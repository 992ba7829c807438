package placement

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// memoEntry is an explanation, valid while no node of a group relevant
// to its shape moves (stamp), and, when it read how many were placed, no
// more are.
type memoEntry struct {
	stamp      int
	readPlaced bool
	placed     int
	pending    Pending
	// behind holds, for an explanation naming the jobs placed ahead, its
	// text around that count (explain's behindHead and behindTail).
	behind [2]string
}

// valid reports whether m explains its key's requests now, given the
// stamp of their shape, updating its text when only the number of jobs
// placed ahead changed. Once that number was read above zero, the branch
// explain takes no longer depends on it (placed only grows; the rest of
// what the branch reads is the stamp's or fixed for the cycle), so only
// the number in its text moves.
func (m *memoEntry) valid(stamp, placed int) bool {
	switch {
	case m.stamp != stamp:
		return false
	case !m.readPlaced || m.placed == placed:
		return true
	case m.placed == 0:
		return false // the count read as zero ruled out the branch that names it
	case m.behind[0] != "":
		m.pending.Message = m.behind[0] + countText(placed, "job") + m.behind[1]
	}
	m.placed = placed
	return true
}

// why explains a request that was not placed, from the most fundamental
// cause to the most transient, and appends the queue and caller facts.
func (p *Placer) why(r *Request) Pending {
	return p.withQueue(p.explainMemo(r), r)
}

// withQueue appends to an explanation the queue and caller facts: the
// text aheadText and "; "+r.Extra would add, built in one buffer and
// turned into one string. Every job a cycle leaves waiting gets one, and
// the count in it moves nearly every cycle, so it cannot be kept; three
// concatenations (the count, the queue text, the whole) allocated three.
func (p *Placer) withQueue(pd Pending, r *Request) Pending {
	if r.Tenant == "" && r.Extra == "" {
		return pd
	}
	b := append(p.msgBuf[:0], pd.Message...)
	if r.Tenant != "" {
		b = appendAhead(b, r.Ahead, r.Tenant)
	}
	if r.Extra != "" {
		b = append(b, "; "...)
		b = append(b, r.Extra...)
	}
	p.msgBuf = b
	pd.Message = string(b)
	return pd
}

// appendAhead appends aheadText's "; N jobs ahead in queue T".
func appendAhead(b []byte, ahead int, tenant string) []byte {
	b = append(b, "; "...)
	b = strconv.AppendInt(b, int64(ahead), 10)
	if ahead == 1 {
		b = append(b, " job"...)
	} else {
		b = append(b, " jobs"...)
	}
	b = append(b, " ahead in queue "...)
	return append(b, tenant...)
}

// explainMemo caches explanations of requests without per-node filters
// (selector, reservations): a long queue of one shape behind a full
// cluster is explained once per placement, not once per job.
func (p *Placer) explainMemo(r *Request) Pending {
	if !memoable(r) {
		return p.explain(r)
	}
	var b []byte
	var prefix int
	var s *shape
	if p.keyReady {
		// failedBefore just built r's key (a deep queue's common case).
		b, prefix, s, p.keyReady = p.keyBuf, p.keyPrefix, p.keyShape, false
	} else {
		s = p.anyShape(r)
		b = p.memoPrefixOf(r, s)
		prefix = len(b)
		b = p.memoPools(r, b)
	}
	stamp := p.stamp(s)
	// The reference (noFailMemo) explains every request afresh; it builds
	// the key all the same, since that asks every pool's verdict, which
	// the caller notes (its quota notes).
	if m, ok := p.memo[string(b)]; ok && !p.noFailMemo && m.valid(stamp, p.placed) {
		return m.pending
	}
	key := string(b)
	p.explaining = key
	p.readPlaced = false
	p.behindHead, p.behindTail = "", ""
	pd := p.explain(r)
	p.explaining = ""
	if len(p.memo) > 4096 {
		clear(p.memo)
	}
	p.memo[key] = &memoEntry{stamp: stamp, readPlaced: p.readPlaced, placed: p.placed, pending: pd,
		behind: [2]string{p.behindHead, p.behindTail}}
	if len(p.failedKeys) > 1<<16 {
		clear(p.failedKeys) // only an optimisation: forgetting is safe
		clear(p.failedPrefix)
	}
	p.failedKeys[key] = struct{}{}
	p.failedPrefix[key[:prefix]] = struct{}{}
	return pd
}

// memoable reports whether r's placement is decided by its memo key:
// no selector, and exclusions only under a key naming them.
func memoable(r *Request) bool {
	return len(r.Selector) == 0 && ((len(r.Exclude) == 0 && len(r.Reserved) == 0) || r.ExcludeKey != "")
}

// memoPrefix is the part of r's memo key that needs no caller verdict:
// shape, counts, host resources and exclusions (in p.keyBuf).
func (p *Placer) memoPrefix(r *Request, s *shape) []byte {
	b := append(p.keyBuf[:0], s.key...)
	return p.memoExclusions(r, appendCounts(b, r))
}

// memoExclusions ends a memo prefix: the exclusions' key.
func (p *Placer) memoExclusions(r *Request, b []byte) []byte {
	if len(r.Exclude) > 0 || len(r.Reserved) > 0 {
		b = append(b, '|')
		b = append(b, r.ExcludeKey...)
	}
	b = append(b, '|')
	p.keyBuf = b
	return b
}

// memoPools appends to a memo prefix the verdict of r.PoolRuns and
// r.AllowPool on every pool in r's scope.
func (p *Placer) memoPools(r *Request, b []byte) []byte {
	for pool := range p.pools.list {
		if r.Pool == "" || p.pools.list[pool] == r.Pool {
			b = append(b, '0'+byte(boolInt(p.poolOK(r, int32(pool)))))
		}
	}
	p.keyBuf = b
	return b
}

// failedBefore reports whether a request with r's memo key failed
// earlier in this cycle. Then r fails too and need not be searched again
// (the tail of a deep queue behind a full cluster costs a map lookup per
// job, and its explanation one per placement): within a cycle devices,
// instances, shares and host capacity are only taken, never given back,
// so a node that could not hold a request never comes to; a failed
// placement has no effect on the Placer but its caches; and the key holds
// everything the search reads (shape, counts, host resources, the
// exclusions' key, every pool verdict) but r.Prefer, which only chooses
// among nodes found.
func (p *Placer) failedBefore(r *Request) bool {
	if p.noFailMemo || len(p.failedKeys) == 0 || !memoable(r) {
		return false
	}
	s := p.anyShape(r)
	b := p.memoPrefixOf(r, s)
	if _, ok := p.failedPrefix[string(b)]; !ok {
		return false // no pool verdict asked before the search
	}
	prefix := len(b)
	b = p.memoPools(r, b)
	_, ok := p.failedKeys[string(b)]
	if ok {
		p.skipped++
		// p.keyBuf holds r's memo key: why's explainMemo, next, reads it.
		p.keyReady, p.keyPrefix, p.keyShape = true, prefix, s
	}
	return ok
}

// placedRead is p.placed, noted as read by the explanation being made.
func (p *Placer) placedRead() int {
	p.readPlaced = true
	return p.placed
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// classFacts is what explain needs of one class for one request.
type classFacts struct {
	hw, capable, fits bool
	tier              int8
	block, cap        int // largest free block now / when empty (whole cards)
	room              [2]int64
	instFree, inst    int // free and existing instances of the profile
}

// explain counts, over the classes in the request's scope, how many
// machines fail each rule, from the most fundamental to the most transient.
// Class facts are cached in the shape (classes never change); members are
// visited one by one only where a per-node rule decides (selector,
// reservations, or host capacity of machines whose GPUs fit).
func (p *Placer) explain(r *Request) Pending {
	desc := p.describe(r)
	pending := func(code contracts.Reason, format string, args ...any) Pending {
		return Pending{Code: code, Message: desc + "; " + fmt.Sprintf(format, args...)}
	}
	where := ""
	if r.Pool != "" {
		where = " in pool " + r.Pool
	}
	switch {
	case len(p.nodes) == 0:
		return pending(contracts.PendingNoNodes, "no nodes are registered")
	case r.Pool != "":
		if id, ok := p.pools.lookup(r.Pool); !ok || p.poolNodes[id] == 0 {
			return pending(contracts.PendingNoNodes, "no nodes in pool %s", r.Pool)
		}
	}
	s := p.anyShape(r)
	m := r.Machines()
	perNode := len(r.Selector) > 0 || len(r.Exclude) > 0 || len(r.Reserved) > 0

	var (
		hw, capable, usable, gpuFit, fit     int
		cordoned, tainted, unselected, quota int
		runtime                              int
		reserved                             int
		capMax, blockMax                     = -1, -1
		capNode, blockNode, cpuNode          string
		roomNode                             string
		cpuBest, memBest                     int64 = -1, -1
		room                                       = [2]int64{-1, -1}
		instFree, inst                       int
		capZone, fitZone                     = map[int32]int{}, map[int32]int{}
	)
	better := func(n int, id string, best int, bestID string) bool { return n > best || n == best && id < bestID }
	// Every sum and maximum below is independent of the classes' order
	// (ties go to the lowest node ID), so the occupied ones suffice.
	for _, cid := range p.occupied {
		c := &p.classes[cid]
		if len(c.members) == 0 || s.pool >= 0 && c.pool != s.pool {
			continue
		}
		f := p.facts(s, cid)
		if !f.hw {
			continue
		}
		size := len(c.members)
		first := p.nodes[c.members[0]].src.ID // members are in node (ID) order
		hw += size
		if better(f.cap, first, capMax, capNode) {
			capMax, capNode = f.cap, first
		}
		if !f.capable {
			continue
		}
		capable += size
		capZone[c.zone] += size
		switch {
		case c.cordoned:
			cordoned += size
			continue
		case f.tier > 1:
			tainted += size
			continue
		case !p.poolRuns(r, c.pool):
			runtime += size
			continue
		case !p.poolOK(r, c.pool):
			quota += size
			continue
		}
		usableHere := 0
		firstUsable := ""
		// A class whose GPUs do not fit has no member a reservation or
		// exclusion could matter for (those count only machines that
		// would take it): only a selector needs the walk then.
		if (!perNode || len(r.Selector) == 0) && !f.fits {
			usableHere, firstUsable = size, first
		} else {
			for _, ord := range c.members {
				n := &p.nodes[ord]
				switch {
				case len(r.Selector) > 0 && !contracts.Selected(r.Selector, n.src.Labels):
					unselected++
					continue
				case excluded(r, n.src.ID) && f.fits && n.cpu >= r.CPUMilli && n.mem >= r.MemoryMiB:
					// It would take the job now but for a reservation (a
					// held node's holes were tried and are too small). A
					// reserved machine it would not fit anyway is no
					// reason: it counts below as usable and full.
					reserved++
					continue
				}
				if usableHere == 0 {
					firstUsable = n.src.ID
				}
				usableHere++
				if !f.fits {
					continue
				}
				gpuFit++
				if better(int(min(n.cpu, 1<<40)), n.src.ID, int(min(cpuBest, 1<<40)), cpuNode) {
					cpuBest, memBest, cpuNode = n.cpu, n.mem, n.src.ID
				}
				if n.cpu >= r.CPUMilli && n.mem >= r.MemoryMiB {
					fit++
					fitZone[n.zone]++
				}
			}
		}
		if usableHere == 0 {
			continue
		}
		usable += usableHere
		switch s.kind {
		case contracts.GPUKindWhole:
			if better(f.block, firstUsable, blockMax, blockNode) {
				blockMax, blockNode = f.block, firstUsable
			}
		case contracts.GPUKindShare:
			if f.room[0] > room[0] || f.room[0] == room[0] && (f.room[1] > room[1] || f.room[1] == room[1] && firstUsable < roomNode) {
				room, roomNode = f.room, firstUsable
			}
		case contracts.GPUKindMIG:
			instFree += f.instFree * usableHere
			inst += f.inst * usableHere
		}
	}

	zone := r.GPU.Topology == contracts.TopologyZone && m > 1
	switch {
	case hw == 0:
		return pending(contracts.PendingNoMatchingModel, "no node%s has %s", where, p.hardware(r))
	case capable == 0 && m == 1:
		return pending(contracts.ReasonUnsatisfiable, "no machine%s could ever hold it%s", where, p.capText(r, capMax, capNode))
	case capable < m:
		capText := ""
		if capable == 0 {
			capText = p.capText(r, capMax, capNode)
		}
		return pending(contracts.ReasonUnsatisfiable, "no job can ever get %d such machines: %s%s could hold its part%s",
			m, countText(capable, "machine"), where, capText)
	case zone && maxOf(capZone) < m:
		z, c := p.mostZone(capZone)
		return pending(contracts.ReasonUnsatisfiable, "no zone has %d machines that could hold its part; most are %d in zone %s", m, c, z)
	}
	if r.CPUMilli > 0 || r.MemoryMiB > 0 {
		if cpu, mem := p.hostMax(s.pool); (cpu >= 0 && cpu < r.CPUMilli) || (mem >= 0 && mem < r.MemoryMiB) {
			return pending(contracts.ReasonUnsatisfiable, "no machine%s could ever hold it: it asks %d milli-CPU and %d MiB host memory per machine; the most any has is %s milli-CPU and %s MiB",
				where, r.CPUMilli, r.MemoryMiB, boundText(cpu), boundText(mem))
		}
	}
	var blocked []string
	add := func(n int, what string) {
		if n > 0 {
			blocked = append(blocked, fmt.Sprintf("%d %s", n, what))
		}
	}
	add(cordoned, "cordoned")
	add(tainted, "tainted NoSchedule (not tolerated)")
	add(runtime, "in a pool whose runtime policy does not run it (host commands or mounts)")
	add(quota, "in a pool without quota headroom")
	add(unselected, "not matching the node selector")
	add(reserved, "reserved for jobs ahead")
	// Machines that could hold it but may not be used, said after the
	// main reason when it is about the usable ones.
	unusable := ""
	if len(blocked) > 0 {
		unusable = "; not usable: " + strings.Join(blocked, ", ")
	}
	if fit < m && usable >= m && fit+reserved >= m {
		// Only reservations keep it waiting: free capacity that would
		// take it now is held for jobs ahead it would delay.
		return pending(contracts.PendingReservedForOther, "%s that could take it now %s reserved for jobs ahead, which it would delay (it runs past their start, or its run time is unknown)%s",
			countText(reserved, "machine"), map[bool]string{true: "is", false: "are"}[reserved == 1], unusableOther(blocked))
	}
	if usable < m {
		code := contracts.PendingNoSchedulableNode
		switch blockedN := capable - usable; {
		case blockedN == quota:
			code = contracts.PendingQuotaExceeded
		case blockedN == reserved:
			code = contracts.PendingReservedForOther
		}
		lead := "none"
		if usable > 0 {
			lead = "only " + strconv.Itoa(usable)
		}
		return pending(code, "%s of the %s that could hold it %s usable: %s", lead, countText(capable, "machine"),
			map[bool]string{true: "is", false: "are"}[usable == 1 || capable == 1], strings.Join(blocked, ", "))
	}
	switch {
	case gpuFit >= m && fit < m && (!zone || maxOf(fitZone) < m):
		return pending(contracts.PendingNoSchedulableNode, "its GPUs are free on %s but %s %d milli-CPU and %d MiB host memory free (most: %d milli-CPU and %d MiB on %s)",
			countText(gpuFit, "machine"), noneText(m), r.CPUMilli, r.MemoryMiB, cpuBest, memBest, cpuNode)
	case fit < m && p.placedRead() > 0 && p.initiallyFitMemo(s, r, m):
		// The text around the count is kept apart: a cached explanation
		// changes only in the count as more jobs are placed (memoEntry).
		head, tail := desc+"; the free capacity went to ", " placed ahead of it this cycle"
		if s.kind == contracts.GPUKindWhole && m == 1 && blockMax >= 0 {
			tail += fmt.Sprintf("; largest free block%s is now %d on %s", p.domainText(r), blockMax, blockNode)
		}
		p.behindHead, p.behindTail = head, tail
		return Pending{Code: contracts.PendingQueuedBehind, Message: head + countText(p.placed, "job") + tail}
	case m > 1 && zone && fit >= m:
		z, c := p.mostZone(fitZone)
		return pending(contracts.PendingInsufficientGPUs, "machines with its GPUs free are in different zones; most are %d in zone %s", c, z)
	case m > 1 && fit >= m:
		return pending(contracts.PendingInsufficientGPUs, "%s have its GPUs free, but not %d of one model", countText(fit, "machine"), m)
	case m > 1 && zone:
		z, c := p.mostZone(fitZone)
		return pending(contracts.PendingInsufficientGPUs, "%s %d free%s; most in one zone: %d in zone %s",
			countText(fit, "machine has", "machines have"), s.k, p.domainText(r), c, z)
	case m > 1:
		return pending(contracts.PendingInsufficientGPUs, "%s %d free%s", countText(fit, "machine has", "machines have"), s.k, p.domainText(r))
	}
	switch s.kind {
	case contracts.GPUKindMIG:
		return pending(contracts.PendingInsufficientGPUs, "%d of the %s on usable machines %s free%s", instFree,
			countText(inst, r.GPU.MIGProfile+" instance"), map[bool]string{true: "is", false: "are"}[instFree == 1], unusable)
	case contracts.GPUKindShare:
		if room[0] < 0 {
			return pending(contracts.PendingInsufficientGPUs, "no usable card has room%s", unusable)
		}
		return pending(contracts.PendingInsufficientGPUs, "the most room on one card is %d%% and %d MiB on %s%s", room[0], room[1], roomNode, unusable)
	}
	if blockMax <= 0 {
		return pending(contracts.PendingInsufficientGPUs, "no matching GPU is free on a usable machine%s", unusable)
	}
	return pending(contracts.PendingInsufficientGPUs, "largest free block%s is %d on %s%s", p.domainText(r), blockMax, blockNode, unusable)
}

// initiallyFitMemo is initiallyFit, remembered for the cycle by the memo
// key of the request explained (p.explaining): the cycle's initial state
// does not change, and the key holds all initiallyFit reads of r.
func (p *Placer) initiallyFitMemo(s *shape, r *Request, m int) bool {
	if p.explaining == "" || p.noFailMemo {
		return p.initiallyFit(s, r, m)
	}
	if v, ok := p.initFit[p.explaining]; ok {
		return v
	}
	v := p.initiallyFit(s, r, m)
	if len(p.initFit) > 1<<16 {
		clear(p.initFit)
	}
	p.initFit[p.explaining] = v
	return v
}

// initiallyFit reports whether m machines could have taken r's parts when
// the cycle started (each node's first class and host capacity then).
func (p *Placer) initiallyFit(s *shape, r *Request, m int) bool {
	n := 0
	for cid := range p.initMembers {
		c := &p.classes[cid]
		if s.pool >= 0 && c.pool != s.pool || c.cordoned {
			continue
		}
		if f := p.facts(s, int32(cid)); !f.fits || f.tier > 1 || !p.poolOK(r, c.pool) {
			continue
		}
		for _, ord := range p.initMembers[cid] {
			src := p.nodes[ord].src
			if src.CPUMilliFree >= r.CPUMilli && src.MemoryMiBFree >= r.MemoryMiB && !excluded(r, src.ID) &&
				(len(r.Selector) == 0 || contracts.Selected(r.Selector, src.Labels)) {
				if n++; n >= m {
					return true
				}
			}
		}
	}
	return false
}

// facts is classFacts cached in the shape.
func (p *Placer) facts(s *shape, cid int32) *classFacts {
	for len(s.facts) < len(p.classes) {
		s.facts = append(s.facts, nil)
	}
	if f := s.facts[cid]; f != nil {
		return f
	}
	f := p.classFacts(s, cid)
	s.facts[cid] = f
	return f
}

// classFacts computes what explain needs of class cid for shape s.
func (p *Placer) classFacts(s *shape, cid int32) *classFacts {
	c := &p.classes[cid]
	f := &classFacts{tier: p.tierOf(s, c.taints)}
	empty := p.scratch2[:0]
	for range c.view {
		empty = append(empty, slot{})
	}
	p.scratch2 = empty
	for i, sl := range c.view {
		empty[i] = slot{kind: sl.kind, domain: sl.domain, migFree: p.kinds[sl.kind].all}
		k := &p.kinds[sl.kind]
		if !s.allows(k.model) {
			continue
		}
		switch s.kind {
		case contracts.GPUKindMIG:
			if !k.mig {
				continue
			}
			for j := range k.inst {
				if k.inst[j].profile == s.profile {
					f.hw = true
					if k.inst[j].memMiB >= s.minMem && !sl.held {
						f.inst++
						if sl.migFree&(1<<j) != 0 {
							f.instFree++
						}
					}
				}
			}
		default:
			f.hw = f.hw || !k.mig
			if s.kind == contracts.GPUKindShare && p.cardOK(k, s) && !sl.held && !k.mig {
				pct, mem := 100-int64(sl.pct), k.memMiB-sl.mem
				if pct > f.room[0] || pct == f.room[0] && mem > f.room[1] {
					f.room = [2]int64{pct, mem}
				}
			}
		}
	}
	if !f.hw {
		return f
	}
	var buf [16]int
	switch s.kind {
	case contracts.GPUKindMIG:
		_, _, f.capable = p.pickMIG(empty, s)
		_, _, f.fits = p.pickMIG(c.view, s)
	case contracts.GPUKindShare:
		_, f.capable = p.pickShare(empty, s)
		_, f.fits = p.pickShare(c.view, s)
	default:
		f.block, f.cap = p.block(c.view, s), p.block(empty, s)
		f.capable, f.fits = f.cap >= s.k, f.block >= s.k
		if f.fits {
			// block counts per model; pickWhole is the judge.
			_, _, f.fits = p.pickWhole(c.view, s, false, buf[:0])
		}
	}
	return f
}

func (p *Placer) cardOK(k *kind, s *shape) bool {
	return k.memMiB >= s.minMem && k.memMiB >= s.shareMem
}

// block is the largest number of free whole cards of one allowed model
// with the framebuffer s needs (in one NVLink domain when s needs NVLink).
func (p *Placer) block(v []slot, s *shape) int {
	best := 0
	for i := range v {
		if !p.wholeOK(&v[i], s, -1) {
			continue
		}
		m := p.kinds[v[i].kind].model
		d := 0
		if s.nvlink {
			if v[i].domain < 0 {
				continue
			}
			d = int(v[i].domain)
		}
		n := 0
		// Count the cards of this model (and domain): small views, so
		// a quadratic count keeps it simple.
		for j := range v {
			if p.wholeOK(&v[j], s, m) && (!s.nvlink || int(v[j].domain) == d) {
				n++
			}
		}
		best = max(best, n)
	}
	return best
}

func (p *Placer) mostZone(z map[int32]int) (string, int) {
	best, bestN := "", -1
	for id, n := range z {
		name := p.zones.list[id]
		if n > bestN || n == bestN && name < best {
			best, bestN = name, n
		}
	}
	if best == "" {
		best = `""`
	}
	return best, max(bestN, 0)
}

func maxOf(z map[int32]int) int {
	m := 0
	for _, n := range z {
		m = max(m, n)
	}
	return m
}

// describe says what r needs: "needs 8×H100-80GB in one NVLink domain".
func (p *Placer) describe(r *Request) string {
	g := &r.GPU
	model := modelText(g.AllowedModels())
	var b strings.Builder
	switch g.Kind() {
	case contracts.GPUKindMIG:
		fmt.Fprintf(&b, "needs a %s MIG instance", g.MIGProfile)
		if model != "GPU" {
			fmt.Fprintf(&b, " of %s", model)
		}
		if g.MemoryMiB > 0 {
			fmt.Fprintf(&b, " with ≥%d MiB", g.MemoryMiB)
		}
	case contracts.GPUKindShare:
		fmt.Fprintf(&b, "needs %d%% and %d MiB of one %s", g.Share.ComputePercent, g.Share.MemoryMiB, model)
		if g.MemoryMiB > 0 {
			fmt.Fprintf(&b, " with ≥%d MiB", g.MemoryMiB)
		}
	default:
		m := g.Machines()
		if m == 1 {
			fmt.Fprintf(&b, "needs %d×%s", g.Count, model)
		} else {
			fmt.Fprintf(&b, "needs %d×%s on each of %d machines", g.Count/m, model, m)
		}
		if g.MemoryMiB > 0 {
			fmt.Fprintf(&b, " with ≥%d MiB each", g.MemoryMiB)
		}
		switch {
		case g.Topology == contracts.TopologyNVLink:
			b.WriteString(" in one NVLink domain")
			if m > 1 {
				b.WriteString(" each")
			}
		case m == 1:
			b.WriteString(" on one machine")
		}
		if g.Topology == contracts.TopologyZone && m > 1 {
			b.WriteString(" in one zone")
		}
	}
	if r.Pool != "" {
		b.WriteString(" in pool " + r.Pool)
	}
	return b.String()
}

func modelText(allowed []string) string {
	switch len(allowed) {
	case 0:
		return "GPU"
	case 1:
		return allowed[0]
	}
	return strings.Join(allowed, "|")
}

// hardware names what no node has: "H100-80GB GPUs out of MIG mode".
func (p *Placer) hardware(r *Request) string {
	model := modelText(r.GPU.AllowedModels())
	switch r.GPU.Kind() {
	case contracts.GPUKindMIG:
		if model == "GPU" {
			return "a MIG instance of profile " + r.GPU.MIGProfile
		}
		return fmt.Sprintf("a MIG instance of profile %s on %s", r.GPU.MIGProfile, model)
	}
	if model == "GPU" {
		return "a GPU out of MIG mode"
	}
	return model + " GPUs out of MIG mode"
}

// capText is why no machine could hold r even empty.
func (p *Placer) capText(r *Request, capMax int, node string) string {
	if r.GPU.Kind() != contracts.GPUKindWhole || capMax < 0 {
		return ""
	}
	if capMax == 0 {
		return ": none has such a GPU" + map[bool]string{true: " in an NVLink domain", false: ""}[r.GPU.Topology == contracts.TopologyNVLink]
	}
	return fmt.Sprintf(": the largest%s has %d (%s)", map[bool]string{true: " NVLink domain", false: " machine"}[r.GPU.Topology == contracts.TopologyNVLink], capMax, node)
}

func (p *Placer) domainText(r *Request) string {
	if r.GPU.Topology == contracts.TopologyNVLink {
		return " in one NVLink domain"
	}
	return ""
}

func noneText(m int) string {
	if m == 1 {
		return "none has"
	}
	return fmt.Sprintf("fewer than %d have", m)
}

// countText is "1 machine", "3 machines"; with two forms, "1 is", "3 are".
func countText(n int, forms ...string) string {
	if len(forms) == 2 {
		if n == 1 {
			return "1 " + forms[0]
		}
		return strconv.Itoa(n) + " " + forms[1]
	}
	if n == 1 {
		return "1 " + forms[0]
	}
	return strconv.Itoa(n) + " " + forms[0] + "s"
}

func aheadText(r *Request) string {
	if r.Tenant == "" {
		return ""
	}
	// Concatenation, not Sprintf: every job a cycle leaves waiting gets one.
	return "; " + countText(r.Ahead, "job") + " ahead in queue " + r.Tenant
}

// excluded reports whether node id is kept from r: excluded, or held by a
// reservation (whose holes explain treats as taken).
func excluded(r *Request, id string) bool {
	if r.Exclude[id] {
		return true
	}
	_, held := r.Reserved[id]
	return held
}

// unusableOther lists the reasons other than reservations that machines
// could not be used, for a message that leads with the reservations.
func unusableOther(blocked []string) string {
	var other []string
	for _, b := range blocked {
		if !strings.HasSuffix(b, "reserved for jobs ahead") {
			other = append(other, b)
		}
	}
	if len(other) == 0 {
		return ""
	}
	return "; not usable: " + strings.Join(other, ", ")
}

// hostMax is the largest host CPU and memory capacity of the nodes of
// pool (-1: every pool), each -1 when some node does not report it (no
// bound). Computed once per pool and cycle: capacities do not change.
func (p *Placer) hostMax(pool int32) (cpu, mem int64) {
	if p.hostCap == nil {
		p.hostCap = map[int32][2]int64{}
	}
	if c, ok := p.hostCap[pool]; ok {
		return c[0], c[1]
	}
	for i := range p.nodes {
		n := &p.nodes[i]
		if pool >= 0 && n.pool != pool {
			continue
		}
		if cpu < 0 && mem < 0 {
			break // unbounded both ways: nothing more to learn
		}
		if cpu >= 0 {
			if c := n.src.CPUMilliCapacity; c <= 0 {
				cpu = -1
			} else {
				cpu = max(cpu, c)
			}
		}
		if mem >= 0 {
			if m := n.src.MemoryMiBCapacity; m <= 0 {
				mem = -1
			} else {
				mem = max(mem, m)
			}
		}
	}
	p.hostCap[pool] = [2]int64{cpu, mem}
	return cpu, mem
}

func boundText(n int64) string {
	if n < 0 {
		return "unbounded"
	}
	return strconv.FormatInt(n, 10)
}
