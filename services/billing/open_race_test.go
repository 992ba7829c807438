package billing_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/billing"
)

// TestReplicasOpeningAtOnceShareOneGeneration: two billing replicas find
// the store without a generation of this server (a first start, or a
// restarted Redis) and Open at the same moment, over a store that holds
// enough old keys for its clear to take several SCAN rounds. They must
// start one generation between them, and what the first to open applies
// in it must stay. Before Open took a lock around its clear, the second
// one's clear deleted the first one's new generation (a second
// generation, so a second replay of USAGE), or, when its SCAN had passed
// the generation's key before it was set, the first one's records in a
// generation that stayed (totals lost).
func TestReplicasOpeningAtOnceShareOneGeneration(t *testing.T) {
	ctx := context.Background()
	r := startRedis(t, false)
	c := r.client()
	for trial := range 16 {
		oldContent(t, c, prefix, 5000)
		stores := []*billing.RedisStore{newRedisStore(t, r, billing.RedisConfig{}), newRedisStore(t, r, billing.RedisConfig{})}
		gens := make([]string, len(stores))
		applied := make([]int, len(stores))
		var wg sync.WaitGroup
		for i, s := range stores {
			wg.Go(func() {
				// The second one comes while the first one clears.
				time.Sleep(time.Duration(i*trial) * time.Millisecond)
				g, err := s.Open(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				gens[i] = g
				// Apply at once, as a projector does after its Open.
				for k := range 20 {
					recs := []contracts.UsageRecord{rec("acme", fmt.Sprintf("s%d-j%d", i, k), 1, 0, 1000, 5)}
					if n, err := s.Apply(ctx, recs); err == nil {
						applied[i] += n
					} else if !errors.Is(err, billing.ErrGenerationChanged) {
						t.Error(err)
					}
				}
			})
		}
		wg.Wait()
		if t.Failed() {
			return
		}
		if gens[0] != gens[1] || gens[0] == "old" {
			t.Fatalf("trial %d: two replicas opening at once started generations %q and %q; want one new one", trial, gens[0], gens[1])
		}
		tot, err := stores[0].Tenant(ctx, "acme")
		if err != nil {
			t.Fatal(err)
		}
		if want := int64(applied[0] + applied[1]); tot.Records != want {
			t.Fatalf("trial %d: generation %q counts %d records; the replicas applied %d in it (%v)", trial, gens[0], tot.Records, want, applied)
		}
		if n, err := c.Exists(ctx, prefix+"job:old:0", prefix+"job:old:4999").Result(); err != nil || n != 0 {
			t.Fatalf("trial %d: old keys left after the clear: %d (%v)", trial, n, err)
		}
		if err := c.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestOpenOutlivesADeadOpener: a replica died holding the opening lock
// (it was clearing). Another one's Open waits for the lock to expire,
// then starts the generation, and leaves no lock behind.
func TestOpenOutlivesADeadOpener(t *testing.T) {
	ctx := context.Background()
	r := startRedis(t, false)
	c := r.client()
	if err := c.Set(ctx, prefix+"opening", "a-dead-replica", 300*time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	s := newRedisStore(t, r, billing.RedisConfig{})
	gen, err := s.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := c.Get(ctx, prefix+"gen").Result(); err != nil || got != gen {
		t.Fatalf("the store's generation is %q (%v); Open said %q", got, err, gen)
	}
	if n, err := c.Exists(ctx, prefix+"opening").Result(); err != nil || n != 0 {
		t.Fatalf("Open left the opening lock behind: %d (%v)", n, err)
	}
	if _, err := s.Apply(ctx, []contracts.UsageRecord{rec("acme", "j1", 1, 0, 1000, 5)}); err != nil {
		t.Fatal(err)
	}
	// Held by someone alive, the lock keeps an Open waiting until its
	// context ends, without opening the breaker.
	if err := c.Set(ctx, prefix+"genrun", "another-server", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(ctx, prefix+"opening", "a-live-replica", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := s.Open(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Open while another replica holds the lock: %v; want it to wait until its context ends", err)
	}
	if st := s.BreakerState(); st != "closed" {
		t.Fatalf("waiting for the lock opened the breaker: %s", st)
	}
}

// prefix is the stores' default key prefix.
const prefix = "{gp-billing}:"

// oldContent fills the store under prefix with a generation of another
// server and n keys.
func oldContent(t *testing.T, c *redis.Client, prefix string, n int) {
	t.Helper()
	ctx := context.Background()
	for base := 0; base < n; base += 50_000 {
		pipe := c.Pipeline()
		pipe.Set(ctx, prefix+"gen", "old", 0)
		pipe.Set(ctx, prefix+"genrun", "another-server", 0)
		for i := base; i < min(n, base+50_000); i++ {
			pipe.HSet(ctx, fmt.Sprintf("%sjob:old:%d", prefix, i), "n", 1)
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAClearerThatLostTheLockStops (review): A clears under the lock;
// between two of its pages the lock goes (expired, evicted, deleted) and
// B opens in full and applies. A must not take the lock back and go on
// clearing B's generation: it fails, and opens B's generation again.
func TestAClearerThatLostTheLockStops(t *testing.T) {
	ctx := context.Background()
	r := startRedis(t, false)
	c := r.client()
	for trial := range 4 {
		oldContent(t, c, prefix, 5000)
		a := newRedisStore(t, r, billing.RedisConfig{})
		b := newRedisStore(t, r, billing.RedisConfig{})
		var genB string
		applied := 0
		billing.BeforeLockCall(a, int32(2+trial), func() { // before one of A's renewals
			genB, applied = takeOver(t, c, b, "acme")
		})
		if _, err := a.Open(ctx); err == nil {
			t.Fatalf("trial %d: A's Open went on after its lock went", trial)
		}
		genA, err := a.Open(ctx)
		if err != nil {
			t.Fatal(err)
		}
		tot, err := b.Tenant(ctx, "acme")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.Apply(ctx, []contracts.UsageRecord{rec("acme", "b-late", 1, 0, 1000, 5)}); err != nil {
			t.Fatalf("trial %d: B's Apply after A opened again: %v", trial, err)
		}
		if genA != genB || tot.Records != int64(applied) {
			t.Fatalf("trial %d: A opened %q, B %q; B applied %d and the store counts %d", trial, genA, genB, applied, tot.Records)
		}
		if err := c.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// takeOver is another replica, b, taking the store while A clears: the
// opening lock goes, b opens and applies 20 records of tenant. It returns
// b's generation and how many records counted.
func takeOver(t *testing.T, c *redis.Client, b *billing.RedisStore, tenant string) (string, int) {
	t.Helper()
	ctx := context.Background()
	if err := c.Del(ctx, prefix+"opening").Err(); err != nil {
		t.Error(err)
	}
	gen, err := b.Open(ctx)
	if err != nil {
		t.Error(err)
		return "", 0
	}
	applied := 0
	for k := range 20 {
		n, err := b.Apply(ctx, []contracts.UsageRecord{rec(tenant, fmt.Sprintf("b-j%d", k), 1, 0, 1000, 5)})
		if err != nil {
			t.Error(err)
		}
		applied += n
	}
	return gen, applied
}

// TestOpenClearsALargeStorePageByPage (review): the clear of a store
// larger than one command timeout can delete is as many calls, each with
// its own timeout. It was one: Open failed, again and again, until the
// breaker opened, each try starting its SCAN afresh.
func TestOpenClearsALargeStorePageByPage(t *testing.T) {
	ctx := context.Background()
	r := startRedis(t, false)
	c := r.client()
	oldContent(t, c, prefix, 200_000)
	s := newRedisStore(t, r, billing.RedisConfig{Timeout: 300 * time.Millisecond})
	gen, err := s.Open(ctx)
	if err != nil {
		t.Fatalf("Open over 200,000 old keys with a 300 ms command timeout: %v (breaker %s)", err, s.BreakerState())
	}
	if left, err := c.DBSize(ctx).Result(); err != nil || left != 2 { // gen and genrun
		t.Fatalf("%d keys left after the clear (%v)", left, err)
	}
	if got, err := c.Get(ctx, prefix+"gen").Result(); err != nil || got != gen {
		t.Fatalf("the store's generation is %q (%v); Open said %q", got, err, gen)
	}
}

// TestARestartDuringOpenFailsIt (review): the server restarts after Open
// read its run_id. The generation it then starts would carry the old
// run_id, and the next replica would clear it (a second generation, and
// what was applied in the first one gone): Open fails instead, and the
// next one starts the generation every replica keeps.
func TestARestartDuringOpenFailsIt(t *testing.T) {
	ctx := context.Background()
	r := startRedis(t, false)
	a := newRedisStore(t, r, billing.RedisConfig{})
	b := newRedisStore(t, r, billing.RedisConfig{})
	restarted := false
	billing.BeforeCommand(a, "mget", func(redis.Cmder) {
		if !restarted {
			restarted = true
			r.kill()
			r.start()
		}
	})
	var genA string
	var err error
	for range 5 { // the first tries meet the dead connection, or the restart
		if genA, err = a.Open(ctx); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Apply(ctx, []contracts.UsageRecord{rec("acme", "a-1", 1, 0, 1000, 5)}); err != nil {
		t.Fatal(err)
	}
	genB, err := b.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tot, err := b.Tenant(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	if genA != genB || tot.Records != 1 {
		t.Fatalf("after a restart during A's Open: A opened %q, B %q; the store counts %d of A's 1 record", genA, genB, tot.Records)
	}
}

// TestTwoOpensOfOneStoreOpenOne (review): one store's Opens share its
// token, so they take turns.
func TestTwoOpensOfOneStoreOpenOne(t *testing.T) {
	ctx := context.Background()
	r := startRedis(t, false)
	c := r.client()
	for trial := range 8 {
		oldContent(t, c, prefix, 5000)
		s := newRedisStore(t, r, billing.RedisConfig{})
		gens := make([]string, 2)
		var wg sync.WaitGroup
		for i := range 2 {
			wg.Go(func() {
				time.Sleep(time.Duration(i*trial) * time.Millisecond)
				var err error
				if gens[i], err = s.Open(ctx); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		cur, err := c.Get(ctx, prefix+"gen").Result()
		if err != nil || gens[0] != cur || gens[1] != cur {
			t.Fatalf("trial %d: one store's two Opens returned %q and %q; the store's generation is %q (%v)", trial, gens[0], gens[1], cur, err)
		}
		if err := c.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestALateUnlinkOfAClearerThatLostTheLockDeletesNothing (second review):
// A's clear sends a page's UNLINK; before it lands the lock goes (a stall
// past its TTL, an eviction), and B opens and applies in a generation whose
// keys have the old keys' names (tenant totals). The UNLINK must not land
// on them: the page is unlinked only while A's token holds the lock, in the
// same script.
func TestALateUnlinkOfAClearerThatLostTheLockDeletesNothing(t *testing.T) {
	ctx := context.Background()
	r := startRedis(t, false)
	c := r.client()
	oldContent(t, c, prefix, 5000)
	pipe := c.Pipeline()
	for i := range 100 {
		pipe.HSet(ctx, fmt.Sprintf("%stenant:t%d", prefix, i), "n", 1000)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	a := newRedisStore(t, r, billing.RedisConfig{})
	b := newRedisStore(t, r, billing.RedisConfig{})
	var genB string
	applied := 0
	fired := false
	tenant := ""
	hook := func(cmd redis.Cmder) {
		has := map[string]bool{}
		for _, a := range cmd.Args()[1:] {
			has[fmt.Sprint(a)] = true
		}
		if fired || has[prefix+"genrun"] {
			return
		}
		for i := range 100 {
			if has[fmt.Sprintf("%stenant:t%d", prefix, i)] {
				tenant = fmt.Sprintf("t%d", i)
			}
		}
		if tenant == "" {
			return
		}
		t.Logf("A's page of %d keys, without genrun, holds tenant:%s", len(has), tenant)
		fired = true
		genB, applied = takeOver(t, c, b, tenant) // A stalled past its TTL
	}
	billing.BeforeCommand(a, "unlink", hook)
	billing.BeforeCommand(a, "evalsha", hook)
	_, errA := a.Open(ctx)
	t.Logf("A's first Open: %v", errA)
	genA, err := a.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tot, err := b.Tenant(ctx, tenant)
	if err != nil {
		t.Fatal(err)
	}
	_, berr := b.Apply(ctx, []contracts.UsageRecord{rec(tenant, "b-late", 1, 0, 1000, 5)})
	t.Logf("A %q B %q; B applied %d, store counts %d; B's later Apply: %v", genA, genB, applied, tot.Records, berr)
	if genA != genB || tot.Records != int64(applied) {
		t.Fatalf("generation %q stays, but B's %d applied records count %d", genB, applied, tot.Records)
	}
}

// TestOpenDoesNotAdoptAGenerationThatOutlivedARestart (second review): a
// replica reads the run_id, the server restarts having lost its last
// writes, and the MGET on a new connection finds the old generation under
// the run_id read before the restart. Open must not adopt it.
func TestOpenDoesNotAdoptAGenerationThatOutlivedARestart(t *testing.T) {
	ctx := context.Background()
	r := startRedis(t, true)
	a := newRedisStore(t, r, billing.RedisConfig{})
	genA := openWith(t, a, rec("acme", "a-1", 1, 0, 1000, 5))
	c := r.client()
	// The last writes before the crash do not reach the disk.
	if err := c.ConfigSet(ctx, "appendonly", "no").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Apply(ctx, []contracts.UsageRecord{rec("acme", "a-2", 1, 0, 1000, 5)}); err != nil {
		t.Fatal(err) // applied and (by the projector) acked
	}
	b := newRedisStore(t, r, billing.RedisConfig{}) // a replica starting now
	restarted := false
	billing.BeforeCommand(b, "mget", func(redis.Cmder) {
		if !restarted {
			restarted = true
			r.kill()
			r.start()
		}
	})
	genB, err := b.Open(ctx)
	t.Logf("A opened %q; B's Open after the restart: %q, %v", genA, genB, err)
	if err != nil { // the restart was noticed: the next Open starts afresh
		if genB, err = b.Open(ctx); err != nil {
			t.Fatal(err)
		}
	}
	tot, _ := b.Tenant(ctx, "acme")
	_, aerr := b.Apply(ctx, []contracts.UsageRecord{rec("acme", "b-1", 1, 0, 1000, 5)})
	_, _, berr := b.Billed(ctx, nil)
	t.Logf("store counts %d of 2 applied; B's Apply: %v; B's Billed: %v", tot.Records, aerr, berr)
	if genB == genA {
		t.Fatalf("B adopted generation %q, which outlived a restart that lost a record (counts %d of 2), and applies into it (err %v)", genB, tot.Records, aerr)
	}
}
