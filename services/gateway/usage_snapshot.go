package gateway

import (
	"bytes"
	"encoding/binary"
	"errors"
	"maps"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The usage part of the read model snapshot (readmodel_snapshot.go):
// the hour cut, the records' digests (sorted, 16 bytes each), then each
// tenant's folded usage: its summary currency, its cut of hours, its hour
// and day buckets and its invoice days. Its size grows with tenants,
// pools, price classes and days (and 16 bytes a record for the digests),
// not with the records' contents.

// encodeUsage writes s's usage to buf.
func (s *modelSnap) encodeUsage(buf *bytes.Buffer) {
	var tmp [binary.MaxVarintLen64]byte
	uv := func(v uint64) { buf.Write(tmp[:binary.PutUvarint(tmp[:], v)]) }
	iv := func(v int64) { buf.Write(tmp[:binary.PutVarint(tmp[:], v)]) }
	str := func(v string) { uv(uint64(len(v))); buf.WriteString(v) }
	iv(s.usageCut)
	ids := s.usageIDs.merged()
	uv(uint64(len(ids)))
	for _, d := range ids {
		buf.Write(d[:])
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
	n := c.uvarint()
	if c.err == nil && n > uint64(len(c.b))/16 {
		c.fail(errors.New("more record digests than bytes"))
		return
	}
	ids := make([]usageDigest, n)
	for i := range ids {
		copy(ids[i][:], c.b[:16])
		c.b = c.b[16:]
		if i > 0 && cmpDigest(ids[i-1], ids[i]) >= 0 {
			c.fail(errors.New("record digests out of order"))
			return
		}
	}
	s.usageIDs = usageDigests{sorted: ids}
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
