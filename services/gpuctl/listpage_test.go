package gpuctl

import (
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestListPages: list --limit N says where the next page starts, and
// --after reads it.
func TestListPages(t *testing.T) {
	h := start(t)
	for i, id := range []string{"old", "mid", "new"} {
		h.queue(contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}},
			Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}, t0.Add(time.Duration(i)*time.Minute))
	}
	h.eventually("three jobs listed", func() bool { _, out, _ := h.run("list"); return strings.Count(out, "queued") == 3 })
	rows := func(out string) []string {
		var ids []string
		for _, l := range strings.Split(out, "\n")[1:] {
			if f := strings.Fields(l); len(f) > 0 && f[0] != "more" {
				ids = append(ids, f[0])
			}
		}
		return ids
	}
	code, out, errOut := h.run("list", "--limit", "2")
	if code != ExitOK || strings.Join(rows(out), " ") != "new mid" || !strings.Contains(out, "more jobs may follow: --after mid\n") {
		t.Fatalf("first page: %d %q %s", code, out, errOut)
	}
	code, out, errOut = h.run("list", "--limit", "2", "--after", "mid")
	if code != ExitOK || strings.Join(rows(out), " ") != "old" || strings.Contains(out, "more jobs") {
		t.Fatalf("second page: %d %q %s", code, out, errOut)
	}
	if code, _, errOut := h.run("list", "--after", "ghost"); code != ExitError || !strings.Contains(errOut, "after: unknown_job") {
		t.Errorf("after an unknown job: %d %s", code, errOut)
	}
}
