package gpuctl

import (
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/services/gateway"
)

// TestRateLimitedRequestsAreRetried: against a gateway that lets tenant
// acme send one request a second (burst 1), back-to-back commands still
// succeed: gpuctl waits out each 429's Retry-After and sends again.
func TestRateLimitedRequestsAreRetried(t *testing.T) {
	h := startWith(t, func(c *gateway.Config) {
		c.Limits = gateway.LimitsConfig{RequestsPerSecond: 1, Burst: 1}
	})
	start := time.Now()
	for i := range 3 {
		code, out, errOut := h.run("list", "--tenant", "acme")
		if code != ExitOK {
			t.Fatalf("list %d: exit %d: %s %s", i+1, code, out, errOut)
		}
		if strings.Contains(errOut, "rate_limited") {
			t.Fatalf("list %d reported the rate limit instead of waiting: %s", i+1, errOut)
		}
	}
	// Three requests at one a second cannot all have gone through at once.
	if time.Since(start) < time.Second {
		t.Fatalf("3 requests at 1/s took %s: the limit was not applied", time.Since(start))
	}
}
