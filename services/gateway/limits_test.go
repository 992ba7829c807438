package gateway

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestTenantLimitsRate(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newTenantLimits(LimitsConfig{RequestsPerSecond: 10, Burst: 5}, func() time.Time { return now })
	for i := range 5 {
		if ok, _ := l.allow("acme"); !ok {
			t.Fatalf("request %d of the burst refused", i+1)
		}
	}
	ok, wait := l.allow("acme")
	if ok {
		t.Fatal("the request after the burst was allowed")
	}
	if wait <= 0 || wait > 100*time.Millisecond {
		t.Fatalf("retry after %s, want (0, 100ms]", wait)
	}
	if ok, _ := l.allow("other"); !ok {
		t.Fatal("another tenant paid for acme's burst")
	}
	now = now.Add(100 * time.Millisecond)
	if ok, _ := l.allow("acme"); !ok {
		t.Fatal("a token did not come back after 100 ms at 10/s")
	}
	if ok, _ := l.allow("acme"); ok {
		t.Fatal("two tokens came back after 100 ms at 10/s")
	}
	if got := retryAfterSeconds(50 * time.Millisecond); got != 1 {
		t.Fatalf("Retry-After %d, want 1", got)
	}
}

func TestTenantLimitsStreams(t *testing.T) {
	l := newTenantLimits(LimitsConfig{StreamsPerTenant: 2}, nil)
	r1, ok1 := l.openStream("acme")
	_, ok2 := l.openStream("acme")
	if !ok1 || !ok2 {
		t.Fatal("streams within the bound refused")
	}
	if _, ok := l.openStream("acme"); ok {
		t.Fatal("a third stream was allowed")
	}
	if _, ok := l.openStream("other"); !ok {
		t.Fatal("another tenant's stream refused")
	}
	r1()
	r1() // a release is idempotent
	if _, ok := l.openStream("acme"); !ok {
		t.Fatal("a released stream did not free its place")
	}
	if _, ok := l.openStream("acme"); ok {
		t.Fatal("a double release freed two places")
	}
}

func TestTenantLimitsOff(t *testing.T) {
	l := newTenantLimits(LimitsConfig{}, nil)
	for range 1000 {
		if ok, _ := l.allow("acme"); !ok {
			t.Fatal("an unlimited tenant was limited")
		}
	}
	var nilLimits *tenantLimits
	if ok, _ := nilLimits.allow("acme"); !ok {
		t.Fatal("nil limits limited")
	}
}

// TestTenantLimitsOnTheAPI: through the real gateway, a tenant over its
// rate gets 429 rate_limited with Retry-After while another tenant is
// served, and one over its open streams gets 429 too_many_streams until
// one of them closes.
func TestTenantLimitsOnTheAPI(t *testing.T) {
	h := startGateway(t, func(c *Config) {
		c.Limits = LimitsConfig{RequestsPerSecond: 0.5, Burst: 3, StreamsPerTenant: 1}
	}, nil)
	for i := range 3 {
		if status, body := h.do(http.MethodGet, "/v1/tenants/acme/jobs", "", nil); status != http.StatusOK {
			t.Fatalf("request %d within the burst: %d %s", i+1, status, body)
		}
	}
	res, err := h.hc.Get(h.url + "/v1/tenants/acme/jobs")
	if err != nil {
		t.Fatal(err)
	}
	var apiErr contracts.APIError
	_ = json.NewDecoder(res.Body).Decode(&apiErr)
	res.Body.Close()
	if res.StatusCode != http.StatusTooManyRequests || apiErr.Error.Reason != contracts.ReasonRateLimited {
		t.Fatalf("over the rate: %d %q, want 429 rate_limited", res.StatusCode, apiErr.Error.Reason)
	}
	if ra, err := strconv.Atoi(res.Header.Get("Retry-After")); err != nil || ra < 1 || ra > 2 {
		t.Fatalf("Retry-After %q, want 1 or 2 seconds", res.Header.Get("Retry-After"))
	}
	if status, body := h.do(http.MethodGet, "/v1/tenants/other/jobs", "", nil); status != http.StatusOK {
		t.Fatalf("another tenant was limited: %d %s", status, body)
	}

	// Streams: "other" still has burst left for two requests.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, h.url+"/v1/tenants/other/events", nil)
	first, err := h.hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Body.Close()
	if first.StatusCode != http.StatusOK {
		t.Fatalf("first stream: %d", first.StatusCode)
	}
	res, err = h.hc.Get(h.url + "/v1/tenants/other/events")
	if err != nil {
		t.Fatal(err)
	}
	apiErr = contracts.APIError{}
	_ = json.NewDecoder(res.Body).Decode(&apiErr)
	res.Body.Close()
	if res.StatusCode != http.StatusTooManyRequests || apiErr.Error.Reason != contracts.ReasonTooManyStreams {
		t.Fatalf("second stream: %d %q, want 429 too_many_streams", res.StatusCode, apiErr.Error.Reason)
	}
}
