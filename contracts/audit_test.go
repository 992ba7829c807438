package contracts

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// chainOf encodes n records chained the way the gateway writes them and
// returns their bodies (index i is stream sequence i+1).
func chainOf(t *testing.T, n int) [][]byte {
	t.Helper()
	var out [][]byte
	prev := ""
	for i := range n {
		rec := AuditRecord{SchemaVersion: SchemaVersion, ID: NewJobID(), Time: time.Unix(int64(i), 0).UTC(),
			Actor: "token:ci", Tenant: "acme", Action: "job.submit", Object: "job-" + string(rune('a'+i)),
			Outcome: AuditSuccess, Prev: prev}
		b, err := json.Marshal(rec)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, b)
		prev = AuditHash(b)
	}
	return out
}

type seqMsg struct {
	seq  uint64
	data []byte
}

func verify(msgs []seqMsg) []AuditBreak {
	var c AuditChain
	var breaks []AuditBreak
	for _, m := range msgs {
		if b := c.Next(m.seq, m.data); b != nil {
			breaks = append(breaks, *b)
		}
	}
	return breaks
}

// TestAuditChainDetectsTampering: an intact chain verifies; altering a
// record, removing one (the middle, or the first), forging one in between
// or swapping two each break it exactly where the tampering shows.
func TestAuditChainDetectsTampering(t *testing.T) {
	const n = 6
	asStored := func(bodies [][]byte) []seqMsg {
		var out []seqMsg
		for i, b := range bodies {
			out = append(out, seqMsg{uint64(i + 1), b})
		}
		return out
	}
	cases := map[string]struct {
		tamper    func([]seqMsg) []seqMsg
		wantBreak []uint64 // the sequences reported as breaks
	}{
		"intact": {tamper: func(m []seqMsg) []seqMsg { return m }},
		"altered record": {
			tamper: func(m []seqMsg) []seqMsg {
				m[2].data = []byte(strings.Replace(string(m[2].data), `"outcome":"success"`, `"outcome":"denied"`, 1))
				return m
			},
			// The altered record still names the right prev; its successor
			// no longer matches its hash.
			wantBreak: []uint64{4},
		},
		"removed record": {
			tamper:    func(m []seqMsg) []seqMsg { return slices.Delete(m, 3, 4) },
			wantBreak: []uint64{5},
		},
		"removed first record": {
			tamper:    func(m []seqMsg) []seqMsg { return m[1:] },
			wantBreak: []uint64{2},
		},
		"forged record appended in between": {
			tamper: func(m []seqMsg) []seqMsg {
				forged, _ := json.Marshal(AuditRecord{ID: "forged", Action: "quota.put", Outcome: AuditSuccess, Prev: "0000"})
				return slices.Insert(m, 2, seqMsg{99, forged})
			},
			wantBreak: []uint64{99, 3},
		},
		"swapped records": {
			tamper: func(m []seqMsg) []seqMsg {
				m[1].data, m[2].data = m[2].data, m[1].data
				return m
			},
			wantBreak: []uint64{2, 3, 4},
		},
		"not a record": {
			tamper: func(m []seqMsg) []seqMsg {
				m[4].data = []byte("garbage")
				return m
			},
			wantBreak: []uint64{5, 6},
		},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			breaks := verify(tc.tamper(asStored(chainOf(t, n))))
			var got []uint64
			for _, b := range breaks {
				got = append(got, b.Seq)
				if b.Reason == "" {
					t.Errorf("break at %d has no reason", b.Seq)
				}
			}
			if !slices.Equal(got, tc.wantBreak) {
				t.Errorf("breaks at %v, want %v (%+v)", got, tc.wantBreak, breaks)
			}
		})
	}
}

func TestAuditChainTail(t *testing.T) {
	bodies := chainOf(t, 3)
	var c AuditChain
	for i, b := range bodies {
		if br := c.Next(uint64(i+1), b); br != nil {
			t.Fatalf("intact chain broke: %+v", br)
		}
	}
	seq, hash := c.Tail()
	if seq != 3 || hash != AuditHash(bodies[2]) || c.Records() != 3 {
		t.Errorf("tail = %d %s after %d records, want 3 %s after 3", seq, hash, c.Records(), AuditHash(bodies[2]))
	}
}

// TestAuditRecordID: the same operation gives the same ID (a retry is one
// record); any part that differs gives another.
func TestAuditRecordID(t *testing.T) {
	base := AuditRecordID("job.submit", "acme", "j1", AuditSuccess, "j1")
	if again := AuditRecordID("job.submit", "acme", "j1", AuditSuccess, "j1"); again != base {
		t.Errorf("same operation: %s then %s", base, again)
	}
	if err := ValidateID(base); err != nil {
		t.Errorf("record ID is not a valid subject token: %v", err)
	}
	others := map[string]string{
		"action":  AuditRecordID("job.cancel", "acme", "j1", AuditSuccess, "j1"),
		"tenant":  AuditRecordID("job.submit", "acme2", "j1", AuditSuccess, "j1"),
		"object":  AuditRecordID("job.submit", "acme", "j2", AuditSuccess, "j1"),
		"outcome": AuditRecordID("job.submit", "acme", "j1", AuditDenied, "j1"),
		"key":     AuditRecordID("job.submit", "acme", "j1", AuditSuccess, "j2"),
		// Length prefixes keep shifted boundaries apart.
		"shifted": AuditRecordID("job.submit", "acmej", "1", AuditSuccess, "j1"),
	}
	for what, id := range others {
		if id == base {
			t.Errorf("a different %s gave the same ID", what)
		}
	}
}

// TestAuditSubjects: the platform scope can never be a tenant, and every
// record subject is under the stream's wildcard with one token per part.
func TestAuditSubjects(t *testing.T) {
	if ValidateTenant(AuditPlatformScope) == nil {
		t.Fatalf("%q is a valid tenant: a tenant's records would mix with the platform's", AuditPlatformScope)
	}
	for tenant, want := range map[string]string{"acme": "gp.audit.acme.r1", "": "gp.audit._platform.r1"} {
		if got := SubjectAudit(tenant, "r1"); got != want {
			t.Errorf("SubjectAudit(%q) = %s, want %s", tenant, got, want)
		}
	}
	if got := SubjectAuditTenant("acme"); got != "gp.audit.acme.*" {
		t.Errorf("SubjectAuditTenant = %s", got)
	}
}

// TestEvidenceStreamsDenyPurgeAndDelete: JOBS, ALLOCATIONS, USAGE and AUDIT
// are evidence; nothing may purge them or delete a message.
func TestEvidenceStreamsDenyPurgeAndDelete(t *testing.T) {
	evidence := []string{StreamJobs, StreamAllocations, StreamUsage, StreamAudit}
	seen := map[string]bool{}
	for _, c := range Streams(StreamOptions{}) {
		if !slices.Contains(evidence, c.Name) {
			continue
		}
		seen[c.Name] = true
		if !c.DenyPurge || !c.DenyDelete || c.AllowRollup || c.MaxAge != 0 || c.Discard != jetstream.DiscardNew {
			t.Errorf("%s: deny purge %v, deny delete %v, rollup %v, max age %s, discard %s; want evidence that never goes",
				c.Name, c.DenyPurge, c.DenyDelete, c.AllowRollup, c.MaxAge, c.Discard)
		}
	}
	for _, name := range evidence {
		if !seen[name] {
			t.Errorf("stream %s is not configured", name)
		}
	}
}
