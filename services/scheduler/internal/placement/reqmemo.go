package placement

import (
	"strconv"
	"sync/atomic"
)

// RequestMemo keeps, for one request that does not change (a queued job's,
// offered to a Placer every cycle), what the placer derives from the
// request alone: the key of its shape and the start of its failure memo
// key (shape, counts, host resources), both fixed for the request, and its
// shape in the Placer that saw it last. With it, a request that waits
// behind a full cluster is looked up by a kept key rather than one built
// afresh (shapeFor and memoPrefix formatting numbers and hashing ~40 bytes
// for each of ~88,000 waiting jobs of a steady cycle).
//
// The zero value is ready. The caller keeps one per request and hands a
// new one (or none) when anything of the request but Tenant, Ahead,
// AllowPool, PoolRuns, Prefer, Exclude, Reserved, ExcludeKey and Extra
// changes. A memo is never shared by requests that differ in GPU, Pool,
// Tolerations, CPUMilli or MemoryMiB.
type RequestMemo struct {
	// shapeKey and prefix are shapeFor's key and memoPrefix's text
	// without the exclusions; "" until first derived.
	shapeKey, prefix string
	// placer and shape name the shape in the Placer (by its id) that
	// last saw the request: its index in shapeList, not a pointer, so a
	// memo kept by a running job holds no Placer's shapes alive.
	placer uint64
	shape  int32
}

// placerIDs numbers Placers, so a memo can tell which one holds its shape
// without keeping a Placer alive.
var placerIDs atomic.Uint64

// PlaceMemo is Place with m, the memo kept with r (nil: as Place). The
// exhaustive reference (Options.Exhaustive) ignores m.
// It reads *r and does not keep it.
func (p *Placer) PlaceMemo(r *Request, m *RequestMemo) Decision {
	if p.noFailMemo {
		m = nil
	}
	p.reqMemo = m
	d := p.place(r)
	p.reqMemo = nil
	return d
}

// anyShape is shapeFor(r, -1), the shape of a request placed on any of
// its allowed models, through the request's memo when it has one.
func (p *Placer) anyShape(r *Request) *shape {
	m := p.reqMemo
	if m == nil {
		return p.shapeFor(r, -1)
	}
	if m.placer == p.id {
		return p.shapeList[m.shape]
	}
	var s *shape
	if m.shapeKey != "" {
		s = p.shapes[m.shapeKey]
	}
	if s == nil {
		s = p.shapeFor(r, -1)
		m.shapeKey = s.key
	}
	m.placer, m.shape = p.id, s.index
	return s
}

// memoPrefixOf is memoPrefix(r, s) for s = anyShape(r), its fixed part
// kept in the request's memo when it has one.
func (p *Placer) memoPrefixOf(r *Request, s *shape) []byte {
	m := p.reqMemo
	if m == nil {
		return p.memoPrefix(r, s)
	}
	if m.prefix == "" {
		b := append(p.keyBuf[:0], s.key...)
		b = appendCounts(b, r)
		// Interned: the jobs of one shape share one text, which a walk
		// over the queue then finds in cache.
		pre, ok := p.prefixes[string(b)]
		if !ok {
			if p.prefixes == nil || len(p.prefixes) > 1<<16 {
				p.prefixes = map[string]string{}
			}
			pre = string(b)
			p.prefixes[pre] = pre
		}
		m.prefix = pre
	}
	b := append(p.keyBuf[:0], m.prefix...)
	return p.memoExclusions(r, b)
}

// appendCounts appends memoPrefix's counts and host resources.
func appendCounts(b []byte, r *Request) []byte {
	for _, v := range [...]int64{int64(r.GPU.Count), int64(r.GPU.Nodes), r.CPUMilli, r.MemoryMiB} {
		b = append(b, '|')
		b = strconv.AppendInt(b, v, 10)
	}
	return b
}

// Key is the request's failure-memo prefix (shape, counts, host
// resources) as the placer last derived it; "" before. Requests whose
// keys, exclusion keys and pool verdicts are equal fail alike while the
// placer's Epoch stays (failedBefore's argument).
func (m *RequestMemo) Key() string { return m.prefix }

// Epoch moves whenever a node's free capacity does (a placement or any
// take): a failure, and its explanation, hold for as long as it stays.
func (p *Placer) Epoch() int { return p.version + p.placed }

// Memoable reports whether r's placement is decided by its memo key and
// pool verdicts: no selector, and exclusions only under a key naming them.
func Memoable(r *Request) bool { return memoable(r) }

// QueueText is pd with r's queue and caller facts appended, as a failed
// Place appends them to its explanation.
func (p *Placer) QueueText(pd Pending, r *Request) Pending { return p.withQueue(pd, r) }

// Explanation is the explanation of a failed Place of r without the queue
// and caller facts QueueText appends; false when pd does not end in them.
func (p *Placer) Explanation(pd Pending, r *Request) (Pending, bool) {
	var b []byte
	if r.Tenant != "" {
		b = appendAhead(p.msgBuf[:0], r.Ahead, r.Tenant)
	} else {
		b = p.msgBuf[:0]
	}
	if r.Extra != "" {
		b = append(b, "; "...)
		b = append(b, r.Extra...)
	}
	p.msgBuf = b
	n := len(pd.Message) - len(b)
	if n < 0 || pd.Message[n:] != string(b) {
		return pd, false
	}
	pd.Message = pd.Message[:n]
	return pd, true
}
