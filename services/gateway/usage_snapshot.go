package gateway

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The usage part of the read model snapshot (readmodel_snapshot.go):
// the hour cut, the records' digests of the duplicate window (when the
// latest record was stored, then the digests sorted, 16 bytes each, each
// with its day after the oldest one), then each
// tenant's folded usage: its summary currency, its cut of hours, its hour
// and day buckets and its invoice days. Its size grows with tenants,
// pools, price classes and days (and 17–20 bytes a record of the duplicate
// window for the digests), not with the records' contents.

// encodeUsage writes s's usage to buf.
func (s *modelSnap) encodeUsage(buf *bytes.Buffer) {
	var tmp [binary.MaxVarintLen64]byte
	uv := func(v uint64) { buf.Write(tmp[:binary.PutUvarint(tmp[:], v)]) }
	iv := func(v int64) { buf.Write(tmp[:binary.PutVarint(tmp[:], v)]) }
	str := func(v string) { uv(uint64(len(v))); buf.WriteString(v) }
	iv(s.usageCut)
	iv(s.usageIDs.latest.Unix())
	uv(uint64(s.usageIDs.latest.Nanosecond()))
	ids := s.usageIDs.clone()
	ids.merge()
	uv(uint64(len(ids.sorted)))
	if len(ids.sorted) > 0 {
		iv(int64(ids.oldest))
	}
	for i, d := range ids.sorted {
		buf.Write(d[:])
		uv(uint64(ids.days[i] - ids.oldest))
	}
	points := func(ps map[pointKey]pointSums) {
		uv(uint64(len(ps)))
		for k, p := range ps {
			iv(k.start)
			str(k.pool)
			str(k.class)
			iv(p.millis)
			iv(p.cost)
			iv(p.onDemand)
		}
	}
	tenants := slices.Sorted(maps.Keys(s.usage))
	uv(uint64(len(tenants)))
	for _, t := range tenants {
		tu := s.usage[t]
		str(t)
		str(tu.currency)
		str(tu.curID)
		iv(tu.curStart.Unix())
		uv(uint64(tu.curStart.Nanosecond()))
		if tu.hoursCut {
			buf.WriteByte(1)
		} else {
			buf.WriteByte(0)
		}
		iv(tu.hoursFrom)
		points(tu.hours)
		points(tu.days)
		uv(uint64(len(tu.invoice)))
		for day, d := range tu.invoice {
			iv(day)
			uv(uint64(len(d.currencies)))
			for _, c := range d.currencies {
				str(c)
			}
			uv(uint64(len(d.lines)))
			for k, l := range d.lines {
				str(string(k.class))
				str(k.model)
				str(k.pool)
				str(k.version)
				iv(k.rate)
				for _, v := range []int64{l.records, l.millis, l.gpuCost, l.cpuCost, l.memCost, l.cost, l.onDemand, l.unpriced} {
					iv(v)
				}
			}
		}
	}
}

// decodeUsage reads what encodeUsage wrote into s; damage fails c.
func (s *modelSnap) decodeUsage(c *cursor) {
	s.usageCut = c.varint()
	sec, nsec := c.varint(), c.uvarint()
	if nsec >= 1e9 {
		c.fail(errors.New("a usage time out of range"))
		return
	}
	// The zero time (nothing stored yet) comes back as itself.
	s.usageIDs = usageWindow{latest: time.Unix(sec, int64(nsec)).UTC()}
	c.usageIDs(&s.usageIDs)
	if c.err != nil {
		return
	}
	points := func() map[pointKey]pointSums {
		n := c.count()
		ps := make(map[pointKey]pointSums, n)
		for range n {
			k := pointKey{start: c.varint(), pool: string(c.bytes()), class: string(c.bytes())}
			ps[k] = pointSums{millis: c.varint(), cost: c.varint(), onDemand: c.varint()}
			if c.err != nil {
				break
			}
		}
		return ps
	}
	for range c.count() {
		t := string(c.bytes())
		tu := newTenantUsage()
		tu.currency, tu.curID = string(c.bytes()), string(c.bytes())
		sec, nsec := c.varint(), c.uvarint()
		if nsec >= 1e9 {
			c.fail(errors.New("a usage time out of range"))
		}
		tu.curStart = time.Unix(sec, int64(nsec)).UTC()
		tu.hoursCut = c.byte1() == 1
		tu.hoursFrom = c.varint()
		tu.hours, tu.days = points(), points()
		for range c.count() {
			day := c.varint()
			d := &usageDay{lines: map[lineKey]lineSums{}}
			for range c.count() {
				d.currencies = append(d.currencies, string(c.bytes()))
			}
			if c.err == nil && !slices.IsSorted(d.currencies) {
				c.fail(errors.New("a day's currencies out of order"))
			}
			for range c.count() {
				k := lineKey{class: contracts.PriceClass(c.bytes()), model: string(c.bytes()), pool: string(c.bytes()),
					version: string(c.bytes()), rate: c.varint()}
				var l lineSums
				for _, v := range []*int64{&l.records, &l.millis, &l.gpuCost, &l.cpuCost, &l.memCost, &l.cost, &l.onDemand, &l.unpriced} {
					*v = c.varint()
				}
				if c.err != nil {
					break
				}
				d.lines[k] = l
			}
			if c.err != nil {
				break
			}
			tu.invoice[day] = d
		}
		if c.err != nil {
			return
		}
		s.usage[t] = tu
	}
}

// usageIDs reads the digests of the duplicate window into w.
func (c *cursor) usageIDs(w *usageWindow) {
	n := c.uvarint()
	if c.err == nil && n > uint64(len(c.b))/17 {
		c.fail(errors.New("more record digests than bytes"))
	}
	if c.err != nil || n == 0 {
		return
	}
	oldest := c.varint()
	if oldest < math.MinInt32 || oldest > math.MaxInt32 {
		c.fail(errors.New("a digest day out of range"))
		return
	}
	w.sorted, w.days, w.oldest = make([]usageDigest, n), make([]int32, n), int32(oldest)
	for i := range w.sorted {
		if len(c.b) < 16 {
			c.fail(io.ErrUnexpectedEOF)
			return
		}
		copy(w.sorted[i][:], c.b[:16])
		c.b = c.b[16:]
		d := c.uvarint()
		if c.err == nil && (i > 0 && cmpDigest(w.sorted[i-1], w.sorted[i]) >= 0 || d > uint64(math.MaxInt32-oldest)) {
			c.fail(errors.New("record digests out of order or their days out of range"))
		}
		if c.err != nil {
			return
		}
		w.days[i] = int32(oldest + int64(d))
	}
}
