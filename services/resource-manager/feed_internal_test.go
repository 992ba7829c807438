package resourcemanager

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/liveness"
)

// agentHeartbeat is a heartbeat as an agent of an 8-GPU machine running
// eight allocations sends it.
func agentHeartbeat(tb testing.TB) []byte {
	tb.Helper()
	hb := contracts.Heartbeat{SchemaVersion: 1, NodeID: "scale0-00042", Incarnation: "5f0c7a1e-i1", Seq: 123456,
		Time: time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC)}
	for i := range 8 {
		hb.Runs = append(hb.Runs, contracts.AllocationID("scale", fmt.Sprintf("job-%07d", i), 1))
	}
	data, err := json.Marshal(hb)
	if err != nil {
		tb.Fatal(err)
	}
	return data
}

// TestHeartbeatIncarnation: the feed's reading of a heartbeat's
// incarnation agrees with encoding/json's whole decode on every body an
// agent writes and on the shapes its fast path hands to encoding/json, and
// refuses what encoding/json refuses.
func TestHeartbeatIncarnation(t *testing.T) {
	cases := []struct {
		name    string
		data    string
		wantErr bool
	}{
		{name: "agent's heartbeat", data: string(agentHeartbeat(t))},
		{name: "no runs", data: `{"schemaVersion":1,"nodeId":"n1","incarnation":"i1","seq":1,"time":"2026-11-27T00:00:00Z","runs":null}`},
		{name: "no incarnation", data: `{"schemaVersion":1,"nodeId":"n1"}`},
		{name: "empty incarnation", data: `{"incarnation":""}`},
		{name: "first key", data: `{"incarnation":"i2","nodeId":"n1"}`},
		{name: "spaces", data: ` { "nodeId" : "n1" , "incarnation" : "i3" } `},
		{name: "escaped value", data: `{"incarnation":"a\"b","runs":["x"]}`},
		{name: "unicode escape", data: `{"incarnation":"\u0069\u0031"}`},
		{name: "other case", data: `{"Incarnation":"i4"}`},
		{name: "duplicate key, last wins", data: `{"incarnation":"i5","incarnation":"i6"}`},
		{name: "duplicate key spaced", data: `{"incarnation" : "i7","incarnation":"i8"}`},
		{name: "key inside a value", data: `{"nodeId":"x\"incarnation\":\"evil","incarnation":"i9"}`},
		{name: "escaped quote before the key", data: `{"x\"incarnation":"evil"}`},
		{name: "nested object", data: `{"meta":{"incarnation":"evil"},"incarnation":"i10"}`},
		{name: "nested only", data: `{"meta":{"incarnation":"evil"}}`},
		{name: "brace in a value", data: `{"nodeId":"{","incarnation":"i11"}`},
		{name: "not JSON", data: `{"incarnation":`, wantErr: true},
		{name: "truncated", data: `{"incarnation":"i1"`, wantErr: true},
		{name: "wrong type", data: `{"incarnation":7}`, wantErr: true},
		{name: "array", data: `["incarnation"]`, wantErr: true},
		{name: "empty", data: ``, wantErr: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := heartbeatIncarnation([]byte(c.data))
			if (err != nil) != c.wantErr {
				t.Fatalf("err = %v, want error %v", err, c.wantErr)
			}
			if err != nil {
				return
			}
			var whole contracts.Heartbeat
			if err := json.Unmarshal([]byte(c.data), &whole); err != nil {
				t.Fatalf("whole decode: %v", err)
			}
			if got != whole.Incarnation {
				t.Fatalf("incarnation = %q, encoding/json reads %q", got, whole.Incarnation)
			}
		})
	}
}

// BenchmarkHeartbeatDecode compares the feed's reading of a heartbeat
// with a whole and a partial encoding/json decode.
func BenchmarkHeartbeatDecode(b *testing.B) {
	data := agentHeartbeat(b)
	b.Run("whole", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var hb contracts.Heartbeat
			if err := json.Unmarshal(data, &hb); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("liveness-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var hb heartbeatLiveness
			if err := json.Unmarshal(data, &hb); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("incarnation", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := heartbeatIncarnation(data); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkOnHeartbeat measures the feed's handler for one heartbeat (its
// reading and the tracker's update under lifeMu) on a fleet of 10,000
// ready nodes, and the liveness check's scan of that fleet (Due and
// Suspects, twice a second in production), apart from the bus's delivery.
func BenchmarkOnHeartbeat(b *testing.B) {
	const nodes = 10000
	now := time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC)
	s := &server{cfg: Config{Now: func() time.Time { return now }}, log: slog.New(slog.DiscardHandler),
		tracker: liveness.New(6 * time.Second), nodesSeq: map[string]uint64{}}
	msgs := make([]*bus.Msg, nodes)
	for n := range nodes {
		id := fmt.Sprintf("scale0-%05d", n)
		s.tracker.Apply(contracts.NodeEvent{Kind: contracts.NodeRegistered, NodeID: id, Incarnation: "5f0c7a1e-i1"}, uint64(n+1), now)
		data := agentHeartbeat(b)
		msgs[n] = &bus.Msg{Subject: contracts.SubjectHeartbeat(id), Data: data}
	}
	b.Run("heartbeat", func(b *testing.B) {
		b.ReportAllocs()
		var seq uint64
		for b.Loop() {
			seq++
			m := msgs[seq%nodes]
			m.StreamSeq = seq
			if err := s.onHeartbeatMsg(context.Background(), m); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("check", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if d := s.tracker.Due(now); len(d) != 0 {
				b.Fatalf("%d decisions", len(d))
			}
			if sp := s.tracker.Suspects(now); len(sp) != 0 {
				b.Fatalf("%d suspects", len(sp))
			}
		}
	})
}

// TestReplacedFeedRefreshesNothingOld: a replaced feed starts with each
// node's newest heartbeat, which the old feed may have delivered already
// (or which was stored before the manager listened): delivered again, it
// must not restart the node's clock, or a dead node would be kept alive
// by every new feed. A newer heartbeat does.
func TestReplacedFeedRefreshesNothingOld(t *testing.T) {
	now := time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC)
	s := &server{cfg: Config{Now: func() time.Time { return now }}, log: slog.New(slog.DiscardHandler),
		tracker: liveness.New(6 * time.Second), nodesSeq: map[string]uint64{}, hbSeq: 100, hbStart: 100}
	for _, n := range []string{"n1", "n2"} {
		s.tracker.Apply(contracts.NodeEvent{Kind: contracts.NodeRegistered, NodeID: n, Incarnation: "i1"}, 1, now)
	}
	hb := func(node string, seq uint64) {
		t.Helper()
		data, err := json.Marshal(contracts.Heartbeat{SchemaVersion: 1, NodeID: node, Incarnation: "i1"})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.onHeartbeatMsg(context.Background(), &bus.Msg{Subject: contracts.SubjectHeartbeat(node), Data: data, StreamSeq: seq}); err != nil {
			t.Fatal(err)
		}
	}
	lostAfter := func(d time.Duration) []string {
		var out []string
		for _, dec := range s.tracker.Due(now.Add(d)) {
			out = append(out, dec.Event.NodeID)
		}
		return out
	}
	// The feed flows (n2 every 2 s: no gap of the whole feed), n1 falls
	// silent after its heartbeat 101.
	hb("n1", 90) // stored before the manager listened
	hb("n1", 101)
	hb("n2", 102)
	now = now.Add(2 * time.Second)
	hb("n2", 103)
	now = now.Add(2 * time.Second)
	hb("n2", 104)
	now = now.Add(time.Second)
	// A new feed: each node's newest heartbeat again, then n2's next one.
	hb("n1", 101)
	hb("n2", 104)
	hb("n2", 105)
	if got := lostAfter(2 * time.Second); len(got) != 1 || got[0] != "n1" {
		t.Fatalf("due 7 s after n1's last new heartbeat: %v, want [n1] (its heartbeat delivered again refreshed it)", got)
	}
	if s.hbSeq != 105 {
		t.Fatalf("hbSeq = %d, want 105", s.hbSeq)
	}
}
