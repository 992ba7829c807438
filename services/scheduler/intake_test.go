package scheduler

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestInvalidTenantSubjectsAreAnswered: a job request stored on a JOBS
// subject that names no valid tenant (upper case, too long, or the literal
// wildcard tokens, which JOBS stores like any other) gets a rejected event
// with reason invalid_tenant on contracts.RejectedSubject(seq), seq being
// what its PubAck said, and is dead-lettered for operators.
func TestInvalidTenantSubjectsAreAnswered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start()
	body := []byte(mustJSON(t, request("x1", 1, h100)))
	subjects := []string{"gp.jobs.submit.ACME", "gp.jobs.submit." + strings.Repeat("a", 33), "gp.jobs.submit.*",
		"gp.jobs.submit.>", "gp.jobs.submit.-acme", "gp.jobs.submit.a_b"}
	seqs := map[string]uint64{}
	for i, subj := range subjects {
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		ack, err := e.bus.PublishRaw(ctx, subj, fmt.Sprintf("bad-tenant-%d", i), body)
		cancel()
		if err != nil {
			t.Fatalf("publish on %s: %v", subj, err)
		}
		seqs[subj] = ack.Sequence
	}
	// A valid request after them is served: the bad ones block nothing.
	e.publishRaw(contracts.SubjectSubmit("acme"), "good", []byte(mustJSON(t, request("good", 1, h100))))
	e.waitEvent("acme", "good", contracts.EventQueued)
	for _, subj := range subjects {
		t.Run(subj, func(t *testing.T) {
			want := contracts.RejectedSubject(seqs[subj])
			var ev contracts.JobEvent
			eventually(t, "the rejection on "+want, func() bool {
				for _, m := range e.events.all() {
					if m.Subject == want {
						ev = decode[contracts.JobEvent](t, m)
						return true
					}
				}
				return false
			})
			if ev.Type != contracts.EventRejected || ev.State != contracts.StateRejected || ev.Reason != contracts.ReasonInvalidTenant ||
				ev.Tenant != contracts.InvalidTenantToken || ev.JobID != contracts.RejectedJobID(seqs[subj]) ||
				len(ev.Errors) != 1 || ev.Errors[0].Field != "tenant" || !strings.Contains(ev.Message, "[a-z0-9-]") {
				t.Fatalf("rejection %+v", ev)
			}
			eventually(t, subj+" in the dead-letter stream", func() bool {
				for _, m := range e.dead.all() {
					if m.Header.Get(contracts.HeaderDeadLetterSubject) == subj {
						return true
					}
				}
				return false
			})
		})
	}
}
