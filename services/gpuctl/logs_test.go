package gpuctl

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// runGang publishes the events of acme/id, a job on two machines, up to
// running attempt 1 and waits until the gateway answers it is running.
func (h *harness) runGang(id string) {
	h.t.Helper()
	req := contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 2, Nodes: 2}},
		Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}
	now := time.Now()
	h.queue(req, now)
	parts := []contracts.Placement{
		{AllocationID: contracts.AllocationPartID("acme", id, 1, 0), NodeID: "node-1", Pool: "p", Devices: []contracts.DeviceRef{{Index: 0}}},
		{AllocationID: contracts.AllocationPartID("acme", id, 1, 1), NodeID: "node-2", Pool: "p", Devices: []contracts.DeviceRef{{Index: 0}}},
	}
	h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, State: contracts.StateScheduled, Tenant: "acme", JobID: id, Attempt: 1,
		Time: now, Placement: &parts[0], Placements: parts})
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, State: contracts.StateRunning, Tenant: "acme", JobID: id, Attempt: 1, Time: now})
	h.eventually("job "+id+" running", func() bool {
		_, out, _ := h.run("get", id)
		return strings.Contains(out, "running")
	})
}

// partChunk publishes a piece of the output of machine rank of acme/id
// attempt 1, as that machine's node agent does.
func (h *harness) partChunk(id string, rank int, off int64, data string, eof bool, exit int) {
	h.t.Helper()
	alloc := contracts.AllocationPartID("acme", id, 1, rank)
	c := contracts.LogChunk{SchemaVersion: contracts.SchemaVersion, AllocationID: alloc, Tenant: "acme", JobID: id, Attempt: 1,
		NodeID: "node-1", Offset: off, Data: data, EOF: eof, ExitCode: exit, Time: time.Now()}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, contracts.SubjectLogs("acme", id, "n1"), contracts.LogChunkID(alloc, off, eof), c); err != nil {
		h.t.Fatal(err)
	}
}

// TestLogsRank: --rank picks the machine of a gang whose output gpuctl
// prints, rank 0 by default; -f follows that machine's output to its own
// end.
func TestLogsRank(t *testing.T) {
	h := start(t)
	h.runGang("g")
	h.runJob("single")
	h.partChunk("g", 0, 0, "rank zero\n", true, 0)
	h.partChunk("g", 1, 0, "rank one\n", false, 0)

	for name, tt := range map[string]struct {
		args           []string
		stdout, stderr string
	}{
		"default": {[]string{"logs", "g"}, "rank zero\n", "gpuctl logs: attempt 1 exited with code 0\n"},
		"rank 0":  {[]string{"logs", "g", "--rank", "0"}, "rank zero\n", "gpuctl logs: attempt 1 on rank 0 exited with code 0\n"},
		"rank 1":  {[]string{"logs", "--rank", "1", "g"}, "rank one\n", ""},
		// Running, nothing written yet: said, not printed as nothing.
		"single 0": {[]string{"logs", "single", "--rank", "0"}, "", "gpuctl logs: no output yet for job single (state running)\n"},
	} {
		if code, out, errOut := h.run(tt.args...); code != ExitOK || out != tt.stdout || errOut != tt.stderr {
			t.Errorf("%s: code %d stdout %q stderr %q; want 0 %q %q", name, code, out, errOut, tt.stdout, tt.stderr)
		}
	}

	stdout, wait := h.runAsync("logs", "-f", "--rank", "1", "g")
	h.eventually("rank 1 so far", func() bool { return stdout.String() == "rank one\n" })
	h.partChunk("g", 1, 9, "done\n", true, 4)
	if code, errOut := wait(); code != ExitOK || stdout.String() != "rank one\ndone\n" ||
		errOut != "gpuctl logs: attempt 1 on rank 1 exited with code 4\n" {
		t.Fatalf("logs -f --rank 1: code %d stdout %q stderr %q", code, stdout.String(), errOut)
	}

	for name, tt := range map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"no rank 2":        {[]string{"logs", "g", "--rank", "2"}, ExitError, "out_of_range"},
		"single, rank 1":   {[]string{"logs", "single", "--rank", "1"}, ExitError, "runs on one machine"},
		"negative rank":    {[]string{"logs", "g", "--rank", "-1"}, ExitUsage, "--rank -1"},
		"rank beyond gang": {[]string{"logs", "g", "--rank", "128"}, ExitUsage, "--rank 128"},
		"rank not numeric": {[]string{"logs", "g", "--rank", "one"}, ExitUsage, "invalid value"},
	} {
		if code, _, errOut := h.run(tt.args...); code != tt.code || !strings.Contains(errOut, tt.stderr) {
			t.Errorf("%s: code %d stderr %q; want %d and %q", name, code, errOut, tt.code, tt.stderr)
		}
	}
}
