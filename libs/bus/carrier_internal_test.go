package bus

import (
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestJobAttrs: the delivery of a message about one job names the job
// (and its node) from its subject and CloudEvents subject; others name
// nothing.
func TestJobAttrs(t *testing.T) {
	for _, tc := range []struct {
		subject, ce string
		want        map[string]string
	}{
		{"gp.jobs.submit.acme", "j1", map[string]string{"gpuplane.tenant": "acme", "gpuplane.job_id": "j1"}},
		{"gp.jobs.cancel.acme", "j1", map[string]string{"gpuplane.tenant": "acme", "gpuplane.job_id": "j1"}},
		{"gp.jobs.events.acme.j1", "acme/j1", map[string]string{"gpuplane.tenant": "acme", "gpuplane.job_id": "j1"}},
		{"gp.alloc.ledger.n1", "acme/j1/2", map[string]string{"gpuplane.tenant": "acme", "gpuplane.job_id": "j1", "gpuplane.node": "n1"}},
		{"gp.runs.n1", "acme/j1/2", map[string]string{"gpuplane.tenant": "acme", "gpuplane.job_id": "j1", "gpuplane.node": "n1"}},
		{"gp.usage.acme", "acme/j1/1", map[string]string{"gpuplane.tenant": "acme", "gpuplane.job_id": "j1"}},
		{"gp.logs.acme.j1.n1", "acme/j1/1", map[string]string{"gpuplane.tenant": "acme", "gpuplane.job_id": "j1", "gpuplane.node": "n1"}},
		{"gp.usage.acme", "other/j1/1", nil},
		{"gp.jobs.submit.acme", "", nil},
		{"gp.alloc.ledger.n1", "", nil},
		{"gp.telemetry.n1", "n1", nil},
		{"gp.plans.scheduler", "", nil},
		{"other", "acme/j1", nil},
	} {
		m := &Msg{Subject: tc.subject, Header: nats.Header{}}
		if tc.ce != "" {
			m.Header.Set(contracts.HeaderCESubject, tc.ce)
		}
		got := map[string]string{}
		for _, kv := range jobAttrs(m) {
			got[string(kv.Key)] = kv.Value.AsString()
		}
		if len(got) != len(tc.want) {
			t.Errorf("%s %q: %v, want %v", tc.subject, tc.ce, got, tc.want)
			continue
		}
		for k, v := range tc.want {
			if got[k] != v {
				t.Errorf("%s %q: %v, want %v", tc.subject, tc.ce, got, tc.want)
			}
		}
	}
}
