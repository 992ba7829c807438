package gpuctl

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestAuditCommand: gpuctl audit lists what was done (a retried submit once),
// filters, pages, and verifies the chain.
func TestAuditCommand(t *testing.T) {
	h := start(t)
	for range 2 {
		if code, out, errOut := h.run("submit", "--id", "audited-1", "--gpus", "1", "--duration", "5s"); code != ExitOK {
			t.Fatalf("submit: %d %s %s", code, out, errOut)
		}
	}
	if code, out, errOut := h.run("submit", "--id", "audited-2", "--gpus", "1", "--duration", "5s"); code != ExitOK {
		t.Fatalf("submit: %d %s %s", code, out, errOut)
	}
	// A platform operation that fails is on record too.
	if code, out, errOut := h.run("cordon", "ghost"); code != ExitError {
		t.Fatalf("cordon of an unknown node: %d %s %s", code, out, errOut)
	}

	// The tenant's records: the retried submit is one line.
	code, out, errOut := h.run("audit", "--action", "job.submit")
	if code != ExitOK {
		t.Fatalf("audit: %d %s %s", code, out, errOut)
	}
	if !strings.HasPrefix(out, "SEQ") || strings.Count(out, "audited-1") != 1 || strings.Count(out, "audited-2") != 1 ||
		!regexp.MustCompile(`job\.submit\s+acme\s+audited-1\s+success\s+-\s+127\.0\.0\.1:`).MatchString(out) {
		t.Errorf("audit table:\n%s", out)
	}
	if strings.Contains(out, "node.cordon") {
		t.Errorf("a tenant's trail shows a platform record:\n%s", out)
	}

	// Every record, as JSON.
	code, out, _ = h.run("audit", "--all", "--action", "node.*", "-o", "json")
	var list contracts.AuditList
	if err := json.Unmarshal([]byte(out), &list); code != ExitOK || err != nil || len(list.Records) != 1 ||
		list.Records[0].Action != "node.cordon" || list.Records[0].Object != "ghost" || list.Records[0].Tenant != "" ||
		list.Records[0].Outcome != contracts.AuditFailure || list.Records[0].Reason != contracts.ReasonUnknownNode {
		t.Errorf("audit --all -o json: %d %s (%v)", code, out, err)
	}

	// A page of one says where the next starts.
	code, out, _ = h.run("audit", "--action", "job.submit", "--limit", "1")
	if code != ExitOK || strings.Count(out, "job.submit") != 1 || !strings.Contains(out, "more records follow: --after ") {
		t.Errorf("audit --limit 1: %d\n%s", code, out)
	}
	if code, out, _ := h.run("audit", "--since", "2000-01-01T00:00:00Z", "--until", "2000-01-02T00:00:00Z"); code != ExitOK ||
		!strings.Contains(out, "no audit records") {
		t.Errorf("audit of a day long ago: %d\n%s", code, out)
	}

	if code, out, _ := h.run("audit", "--tenant", contracts.AuditPlatformScope); code != ExitOK || !strings.Contains(out, "node.cordon") || strings.Contains(out, "job.submit") {
		t.Errorf("audit --tenant _platform: %d\n%s", code, out)
	}

	code, out, _ = h.run("audit", "--verify")
	if code != ExitOK || !regexp.MustCompile(`audit chain intact: \d+ records, last seq \d+, hash [0-9a-f]{64}`).MatchString(out) {
		t.Errorf("audit --verify: %d\n%s", code, out)
	}

	for name, args := range map[string][]string{
		"bad since":  {"audit", "--since", "yesterday"},
		"bad limit":  {"audit", "--limit", "0"},
		"positional": {"audit", "extra"},
	} {
		if code, _, errOut := h.run(args...); code != ExitUsage || !strings.Contains(errOut, "gpuctl audit") {
			t.Errorf("%s: exit %d, stderr %q; want a usage error", name, code, errOut)
		}
	}
	// A filter the gateway refuses is an error, with its reason.
	if code, _, errOut := h.run("audit", "--outcome", "maybe"); code != ExitError || !strings.Contains(errOut, "outcome") {
		t.Errorf("audit --outcome maybe: exit %d, stderr %q", code, errOut)
	}
}
