package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/e2e/oracle"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// signal sends sig to the child's current process, if it runs.
func (c *child) signal(sig syscall.Signal) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd != nil {
		fmt.Fprintf(c.log, "=== e2e: %v at %s\n", sig, time.Now().Format(time.RFC3339Nano))
		_ = c.cmd.Process.Signal(sig)
	}
}

// TestSchedulerReplicasRaceWithoutDoubleAllocation runs two scheduler
// replicas (one name, so one lease) against the real resource manager and
// a simulated fleet, with a lease of 300 ms, while jobs flow. A chaos loop
// freezes one replica at a time with SIGSTOP for longer than the lease
// (so the other takes over while the frozen one still believes it leads,
// with plans half published), thaws it, and now and then SIGKILLs and
// restarts one. A thawed ex-leader's plans carry a stale epoch: the
// resource manager must refuse them. Every job must succeed exactly once
// and the oracle must find no GPU held twice (G1) and no job run twice
// without a requeue (J1).
func TestSchedulerReplicasRaceWithoutDoubleAllocation(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the services as processes")
	}
	rng := rand.New(rand.NewPCG(seed(t), 11))
	bin := t.TempDir()
	buildServices(t, bin)
	// The second replica is the same binary under another name.
	if err := os.Symlink(filepath.Join(bin, "scheduler"), filepath.Join(bin, "scheduler-b")); err != nil {
		t.Fatal(err)
	}
	ns := natstest.Start(t)
	tmp := t.TempDir()
	fleetPath := filepath.Join(tmp, "fleet.yaml")
	if err := os.WriteFile(fleetPath, []byte(crashFleet), 0o644); err != nil {
		t.Fatal(err)
	}
	schedArgs := []string{"-lease-ttl", "300ms"}
	order := []string{"fleet-sim", "resource-manager", "scheduler", "scheduler-b"}
	children := startChildren(t, bin, tmp, ns, order, map[string][]string{
		"fleet-sim":   {"-fleet", fleetPath, "-log-dir", t.TempDir()},
		"scheduler":   schedArgs,
		"scheduler-b": schedArgs,
	})
	s := connectClient(t, ns.URL(), natstest.Operator(t, ns), "e2e-replicas-client")
	nc, js := s.nc, s.js
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	waitStreams(t, ctx, js, contracts.StreamJobs, contracts.StreamJobEvents, contracts.StreamAllocations, contracts.StreamRuns)
	w := s.watchJobs(t)

	tenants := []string{"acme", "globex", "initech"}
	jobs := make([]submitted, 60)
	for i := range jobs {
		req := contracts.JobRequest{
			ID:        fmt.Sprintf("race-%03d", i),
			Resources: contracts.Resources{GPU: crashShapes[rng.IntN(len(crashShapes))]},
			Run:       contracts.RunSpec{Duration: contracts.Duration(time.Duration(300+rng.IntN(1200)) * time.Millisecond)},
		}
		jobs[i] = submitted{tenant: tenants[rng.IntN(len(tenants))], id: req.ID, req: req}
	}

	// The chaos loop runs a fixed number of actions over the submit
	// window (about 8 s), whatever the progress.
	const chaosActions = 10
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var chaos []string
	// The chaos loop draws from its own generator: the submit loop below
	// draws from rng at the same time.
	crng := rand.New(rand.NewPCG(rng.Uint64(), 12))
	wg.Go(func() {
		rng := crng
		replicas := []*child{children["scheduler"], children["scheduler-b"]}
		for i := range chaosActions {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(100+rng.IntN(300)) * time.Millisecond):
			}
			c := replicas[rng.IntN(2)]
			if i%4 == 3 {
				_ = c.kill()
				time.Sleep(time.Duration(50+rng.IntN(300)) * time.Millisecond)
				if err := c.start(); err != nil {
					t.Error(err)
					return
				}
				chaos = append(chaos, "kill "+c.name)
				continue
			}
			frozen := time.Duration(400+rng.IntN(1200)) * time.Millisecond
			c.signal(syscall.SIGSTOP)
			time.Sleep(frozen)
			c.signal(syscall.SIGCONT)
			chaos = append(chaos, fmt.Sprintf("freeze %s %s", c.name, frozen.Round(time.Millisecond)))
		}
	})
	submitStart := time.Now()
	for i, j := range jobs {
		body, _ := json.Marshal(j.req)
		if _, err := s.submitBus(ctx, j.tenant, contracts.SubmitMsgID(j.tenant, j.id), body); err != nil {
			t.Fatalf("submit %s/%s: %v", j.tenant, j.id, err)
		}
		if i%6 == 5 {
			time.Sleep(time.Duration(400+rng.IntN(600)) * time.Millisecond)
		}
	}
	wg.Wait()
	close(stop)
	for _, c := range []*child{children["scheduler"], children["scheduler-b"]} {
		c.signal(syscall.SIGCONT) // never leave one frozen
	}
	t.Logf("chaos: %s", strings.Join(chaos, "; "))
	waitFor(t, 2*time.Minute, "all jobs to succeed", func() (bool, string) { return w.progress(jobs) })
	waitFor(t, time.Minute, "the durable consumers to drain", func() (bool, string) {
		st := consumerStats(ctx, js)
		return st == "all drained", st
	})
	rep, err := oracle.Check(ctx, nc)
	if err != nil {
		t.Fatal(err)
	}
	if err := rep.Err(); err != nil {
		t.Fatal(err)
	}
	// How many plans were fenced, for the log only: whether a deposed
	// leader gets a plan out before it stops depends on timing (often
	// none does); the fence itself is proved by the resource manager's
	// fence_test.go.
	stale := 0
	cons, err := js.OrderedConsumer(ctx, contracts.StreamAllocations, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{contracts.SubjectRefusedAll}})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.FetchNoWait(10000)
	if err != nil {
		t.Fatal(err)
	}
	for m := range batch.Messages() {
		var r contracts.Refusal
		if json.Unmarshal(m.Data(), &r) == nil && r.Reason == contracts.RefusedStaleEpoch {
			stale++
		}
	}
	for _, j := range jobs {
		oj, ok := rep.Jobs[j.tenant+"/"+j.id]
		if !ok || oj.State != contracts.StateSucceeded {
			t.Errorf("job %s/%s: %+v", j.tenant, j.id, oj)
		}
	}
	for _, name := range order {
		for _, e := range children[name].unexpectedExits() {
			t.Error(e)
		}
	}
	t.Logf("oracle: %s; %d plan items refused for a stale epoch; all succeeded %.1fs after the first submit",
		rep.Summary(), stale, time.Since(submitStart).Seconds())
}
