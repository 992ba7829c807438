package gateway

import (
	"testing"
	"time"
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
