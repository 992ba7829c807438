package gateway

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestTailFrameAsCompact: the frame built from an event decoded once
// (buildTailEvent, skipping json.Compact when the body is compact already)
// is the frame parseTailEvent built with json.Compact, for compact
// bodies, bodies with whitespace inside and outside strings, escapes and
// line breaks; and a job event subject's tokens are contracts.Token's.
func TestTailFrameAsCompact(t *testing.T) {
	for _, body := range []string{
		`{"schemaVersion":1,"type":"queued","tenant":"acme","jobId":"j1"}`,
		`{"type":"pending","tenant":"acme","jobId":"j1","message":"waiting for 8 GPUs\tand more"}`,
		`{"type":"pending","tenant":"acme","jobId":"j1","message":"a \"quoted\" word\\"}`,
		`{"type":"pending", "tenant":"acme","jobId":"j1"}`,
		"{\"type\":\"pending\",\n\"tenant\":\"acme\",\"jobId\":\"j1\"}",
		"{\"type\":\"pending\",\t\"tenant\":\"acme\",\"jobId\":\"j1\"}",
		"{\"type\":\"pending\",\"tenant\":\"acme\",\"jobId\":\"j1\",\"message\":\"a\\nb\"}",
		`{"type":"pending","tenant":"acme","jobId":"j1","message":"\\\\"}`,
	} {
		var want bytes.Buffer
		if err := json.Compact(&want, []byte(body)); err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		var ev contracts.JobEvent
		if err := json.Unmarshal([]byte(body), &ev); err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		e, err := buildTailEvent("gp.jobs.events.acme.j1", 7, []byte(body), ev.Type, ev.Tenant)
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		if string(e.data) != want.String() || bytes.Count(e.frame, []byte("\n")) != 4 {
			t.Errorf("body %q: data %q, want %q; frame %q", body, e.data, want.String(), e.frame)
		}
		old, err := parseTailEvent("gp.jobs.events.acme.j1", 7, []byte(body))
		if err != nil || string(old.frame) != string(e.frame) {
			t.Errorf("body %q: frame %q, parseTailEvent's %q (%v)", body, e.frame, old.frame, err)
		}
	}
	for _, subject := range []string{"gp.jobs.events.acme.j1", "gp.jobs.events.acme", "gp.jobs.events.acme.j1.x", "gp.jobs.events",
		"gp.jobs.events..j1", "gp.jobs.events.acme.", "", "a.b.c.d.e"} {
		tenant, job := jobEventSubject(subject)
		wantTenant, wantJob := contracts.Token(subject, 3), contracts.Token(subject, 4)
		if wantTenant == "" {
			wantJob = "" // refused on its tenant either way
		}
		if tenant != wantTenant || job != wantJob {
			t.Errorf("%q: %q %q, want %q %q", subject, tenant, job, wantTenant, wantJob)
		}
		gotTenant, plain := subjectTenant(subject)
		if gotTenant != wantTenant || plain != (strings.Count(subject, ".") == 4) {
			t.Errorf("subjectTenant(%q) = %q %v", subject, gotTenant, plain)
		}
	}
}
