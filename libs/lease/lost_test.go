package lease_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/lease"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// leasesAt opens the leases bucket of srv as a service does, connected to
// url (srv's, or a proxy's in front of it).
func leasesAt(t *testing.T, srv *natsserver.Server, url string) jetstream.KeyValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// The leases are the scheduler's and the resource manager's: use the
	// bucket with a service's identity, as they do.
	b, err := bus.Connect(ctx, bus.Config{URL: url, Name: "test",
		CredsFile: natstest.Service(t, srv, contracts.BusResourceManager)})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	kv, err := b.KeyValue(ctx, contracts.BucketLeases)
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// TestRunEndsATermWhoseRenewalIsLost is the resource manager's term that
// CI once saw invalid for a minute, and never ended (e2e's
// TestNATSNodeLossStopsNoRun): a renewal was sent to the NATS server that
// died with the leader's connection, so its answer never came. Its Update
// waited for the context's deadline (nats.go bounds a request by its 5 s
// default only when the context has none; the test's had two minutes),
// and the elector, waiting with it, could neither end the term at its
// deadline nor contend again. The term must end by its own deadline
// whatever the bus does, and the contender must lead again once the bus
// answers again.
func TestRunEndsATermWhoseRenewalIsLost(t *testing.T) {
	srv := natstest.Start(t)
	p := natstest.NewLossyProxy(t, srv)
	kv := leasesAt(t, srv, p.URL())
	const ttl = time.Second
	e, err := lease.New(lease.Config{KV: kv, Key: "k", Holder: "a", TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	// A far deadline, as the e2e test's context had: the requests inherit
	// it instead of nats.go's default bound.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	type lead struct {
		epoch uint64
		term  lease.Term
		ended chan time.Time // when the term's context ended
	}
	leads := make(chan lead, 4)
	runErr := runElector(t, ctx, cancel, e, func(ctx context.Context, tm lease.Term) error {
		l := lead{epoch: tm.Epoch, term: tm, ended: make(chan time.Time, 1)}
		leads <- l
		<-ctx.Done()
		l.ended <- time.Now()
		return nil
	})
	var first lead
	select {
	case first = <-leads:
	case <-time.After(10 * time.Second):
		t.Fatal("no term began")
	}

	// The server goes silent for longer than a renewal period, so a
	// renewal is sent into the silence, then dies; the client reconnects
	// at once, and everything sent from then on is answered.
	lost := time.Now()
	p.Silence()
	time.Sleep(ttl / 2)
	p.Die()

	// The term was renewed at most TTL before the silence began: it ends
	// by then, plus the time to notice (generous for -race on a busy
	// machine), not when the lost renewal's context does.
	limit := lost.Add(ttl + 2*time.Second)
	select {
	case at := <-first.ended:
		if at.After(limit) {
			t.Errorf("term ended %s after the server went silent; want within %s", at.Sub(lost), limit.Sub(lost))
		}
	case <-time.After(time.Until(limit)):
		t.Fatalf("term %d still running %s after the server went silent (valid: %v): the elector is held by a lost renewal",
			first.epoch, time.Since(lost).Round(time.Millisecond), first.term.Valid())
	}
	// And the contender leads again, on the connection that came back.
	select {
	case next := <-leads:
		if next.epoch != first.epoch+1 {
			t.Errorf("next term at epoch %d; want %d", next.epoch, first.epoch+1)
		}
	case err := <-runErr:
		t.Fatalf("Run returned %v; want it to contend again", err)
	case <-time.After(3*ttl + 5*time.Second):
		t.Fatal("no new term after the lost one ended")
	}
}

// TestRunContendsAgainAfterALostAcquire: the same lost request, sent by a
// contender while another holds the lease. Its Get waited for the
// context's deadline, so the contender stopped contending: once the
// holder let the lease go, no one took it.
func TestRunContendsAgainAfterALostAcquire(t *testing.T) {
	srv := natstest.Start(t)
	p := natstest.NewLossyProxy(t, srv)
	const ttl = time.Second
	holder, err := lease.New(lease.Config{KV: leasesAt(t, srv, srv.URL()), Key: "k", Holder: "b", TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	held, ok, err := holder.TryAcquire(context.Background())
	if !ok || err != nil {
		t.Fatalf("holder: ok=%v err=%v", ok, err)
	}
	e, err := lease.New(lease.Config{KV: leasesAt(t, srv, p.URL()), Key: "k", Holder: "a", TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // as e2e's
	leads := make(chan uint64, 1)
	runErr := runElector(t, ctx, cancel, e, func(ctx context.Context, tm lease.Term) error {
		leads <- tm.Epoch
		<-ctx.Done()
		return nil
	})
	// Silent for longer than a contender's poll (TTL/3): an acquire is
	// sent into the silence. Then the server dies and the client
	// reconnects.
	time.Sleep(ttl / 2)
	p.Silence()
	time.Sleep(ttl / 2)
	p.Die()
	if err := holder.Release(context.Background(), held); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	select {
	case epoch := <-leads:
		if epoch != held.Epoch+1 {
			t.Errorf("contender leads at epoch %d; want %d", epoch, held.Epoch+1)
		}
	case err := <-runErr:
		t.Fatalf("Run returned %v; want it to contend", err)
	case <-time.After(2*ttl + 3*time.Second):
		t.Fatalf("the lease was free for %s and the contender did not take it: its lost acquire holds it",
			time.Since(released).Round(time.Millisecond))
	}
}

// runElector runs e with lead until the test ends, then cancels ctx and
// expects Run to return nil within 10 s. Run's result, should it return
// earlier, arrives on the channel.
func runElector(t *testing.T, ctx context.Context, cancel context.CancelFunc, e *lease.Elector,
	lead func(context.Context, lease.Term) error) <-chan error {
	t.Helper()
	runErr := make(chan error, 1)
	go func() { runErr <- e.Run(ctx, lead) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-runErr:
			if err != nil {
				t.Errorf("Run = %v after its context ended; want nil", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Run did not return 10 s after its context ended")
		}
	})
	return runErr
}
