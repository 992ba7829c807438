package billing_test

import (
	"context"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/billing"
)

func TestMemoryStore(t *testing.T) {
	testStore(t, func(*testing.T) billing.Store { return billing.NewMemoryStore() })
}

// testStore is the conformance test every Store implementation passes.
func testStore(t *testing.T, newStore func(*testing.T) billing.Store) {
	rec := func(tenant, job string, attempt int, millis int64) contracts.UsageRecord {
		id := contracts.AllocationID(tenant, job, attempt)
		return contracts.UsageRecord{ID: contracts.UsageID(id), AllocationID: id, Tenant: tenant, JobID: job,
			Attempt: attempt, GPUMillis: millis}
	}
	totals := func(t *testing.T, s billing.Store, tenant, job string) (billing.Totals, billing.Totals) {
		t.Helper()
		ctx := context.Background()
		tt, err := s.Tenant(ctx, tenant)
		if err != nil {
			t.Fatal(err)
		}
		jt, err := s.Job(ctx, tenant, job)
		if err != nil {
			t.Fatal(err)
		}
		return tt, jt
	}

	t.Run("sums by tenant and by job", func(t *testing.T) {
		s := newStore(t)
		for _, r := range []contracts.UsageRecord{
			rec("acme", "j1", 1, 1000), rec("acme", "j1", 2, 250), rec("acme", "j2", 1, 7), rec("beta", "j1", 1, 5),
		} {
			if err := s.Add(context.Background(), r); err != nil {
				t.Fatal(err)
			}
		}
		tenant, job := totals(t, s, "acme", "j1")
		if tenant != (billing.Totals{Records: 3, GPUMillis: 1257}) || job != (billing.Totals{Records: 2, GPUMillis: 1250}) {
			t.Errorf("acme = %+v, acme/j1 = %+v", tenant, job)
		}
		if tenant.GPUSeconds() != 1.257 {
			t.Errorf("GPUSeconds = %v", tenant.GPUSeconds())
		}
		if _, job := totals(t, s, "beta", "j1"); job != (billing.Totals{Records: 1, GPUMillis: 5}) {
			t.Errorf("beta/j1 = %+v: jobs of different tenants are different jobs", job)
		}
	})
	t.Run("idempotent on the record ID", func(t *testing.T) {
		s := newStore(t)
		r := rec("acme", "j1", 1, 1000)
		for range 3 {
			if err := s.Add(context.Background(), r); err != nil {
				t.Fatal(err)
			}
		}
		if tenant, job := totals(t, s, "acme", "j1"); tenant != job || tenant != (billing.Totals{Records: 1, GPUMillis: 1000}) {
			t.Errorf("after three adds of one record: tenant %+v, job %+v", tenant, job)
		}
	})
	t.Run("unknown is zero", func(t *testing.T) {
		s := newStore(t)
		if tenant, job := totals(t, s, "nobody", "none"); tenant != (billing.Totals{}) || job != (billing.Totals{}) {
			t.Errorf("unknown tenant %+v, job %+v", tenant, job)
		}
	})
}
