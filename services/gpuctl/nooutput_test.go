package gpuctl

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestLogsSaySoWhenThereIsNoOutput: logs of a job that has written
// nothing yet used to print nothing and exit 0, as if the run had printed
// an empty line; it now says so on stderr, with the job's state, and -f
// says it waits for a job not started yet, then prints its output.
func TestLogsSaySoWhenThereIsNoOutput(t *testing.T) {
	h := start(t)
	req := contracts.JobRequest{ID: "q1", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}}, Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}
	h.queue(req, time.Now())
	h.eventually("job q1 queued", func() bool { _, out, _ := h.run("get", "q1"); return strings.Contains(out, "queued") })

	code, out, errOut := h.run("logs", "q1")
	if code != ExitOK || out != "" || errOut != "gpuctl logs: no output yet for job q1 (state queued)\n" {
		t.Fatalf("logs of a queued job: code %d stdout %q stderr %q", code, out, errOut)
	}

	// Following a job not started: said at once, then its output.
	var stdout, stderr syncBuffer
	codes := make(chan int, 1)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	go func() { codes <- Run(ctx, []string{"logs", "-f", "q1"}, &stdout, &stderr, h.env) }()
	h.eventually("the wait said", func() bool { return stderr.String() == "gpuctl logs: job q1 is queued: waiting for its output\n" })
	now := time.Now()
	placement := &contracts.Placement{AllocationID: contracts.AllocationID("acme", "q1", 1), NodeID: "node-1", Pool: "p", Devices: []contracts.DeviceRef{{Index: 0}}}
	h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, State: contracts.StateScheduled, Tenant: "acme", JobID: "q1", Attempt: 1, Time: now, Placement: placement})
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, State: contracts.StateRunning, Tenant: "acme", JobID: "q1", Attempt: 1, Time: now})
	h.chunk("q1", 0, "started\n", false, 0)
	h.eventually("the output", func() bool { return stdout.String() == "started\n" })
	h.chunk("q1", 8, "", true, 0)
	if code := <-codes; code != ExitOK || stdout.String() != "started\n" ||
		stderr.String() != "gpuctl logs: job q1 is queued: waiting for its output\ngpuctl logs: attempt 1 exited with code 0\n" {
		t.Fatalf("logs -f of a queued job: code %d stdout %q stderr %q", code, stdout.String(), stderr.String())
	}

	// A job that ended without writing anything: not "yet".
	h.queue(contracts.JobRequest{ID: "c1", Resources: req.Resources, Run: req.Run}, time.Now())
	h.publishEvent(contracts.JobEvent{Type: contracts.EventCancelled, State: contracts.StateCancelled, Tenant: "acme", JobID: "c1", Attempt: 1, Time: time.Now()})
	h.eventually("job c1 cancelled", func() bool { _, out, _ := h.run("get", "c1"); return strings.Contains(out, "cancelled") })
	code, out, errOut = h.run("logs", "c1")
	if code != ExitOK || out != "" || errOut != "gpuctl logs: job c1 wrote no output (state cancelled)\n" {
		t.Fatalf("logs of a job cancelled while queued: code %d stdout %q stderr %q", code, out, errOut)
	}
}

// TestBudgetAlertLevels: budget set and get printed "alerts sent at []%"
// when no alert had gone out; they now say which levels alert and which
// have.
func TestBudgetAlertLevels(t *testing.T) {
	status := func(alerted ...int) *contracts.BudgetStatus {
		return &contracts.BudgetStatus{PeriodName: "2026-11", Currency: "USD", LimitMicros: 250_000_000, SpentMicros: 210_000_000,
			Policy: contracts.PolicyNotify, Alerted: alerted}
	}
	for name, tt := range map[string]struct {
		status *contracts.BudgetStatus
		want   string
	}{
		"none sent": {status(), "2026-11: spent 210.00 of 250.00 USD (84.0%), within budget; no alert sent yet (alerts at 50%, 80%, 100%)\n"},
		"one sent":  {status(50), "2026-11: spent 210.00 of 250.00 USD (84.0%), within budget; alert sent at 50% (of 50%, 80%, 100%)\n"},
		"two sent":  {status(50, 80), "2026-11: spent 210.00 of 250.00 USD (84.0%), within budget; alerts sent at 50%, 80% (of 50%, 80%, 100%)\n"},
		"no status": {nil, "no status from billing yet\n"},
	} {
		t.Run(name, func(t *testing.T) {
			var out bytes.Buffer
			a := &app{stdout: &out}
			a.printBudget(contracts.BudgetDoc{Tenant: "acme", Budget: &contracts.Budget{Period: contracts.BudgetMonthly,
				Limit: 250_000_000, Policy: contracts.PolicyNotify}, Status: tt.status})
			head := "tenant acme: monthly budget of 250.00, policy notify at 100%\n"
			if out.String() != head+tt.want {
				t.Errorf("got\n%s\nwant\n%s%s", out.String(), head, tt.want)
			}
			if strings.Contains(out.String(), "[]") {
				t.Errorf("an empty list printed: %q", out.String())
			}
		})
	}
}
