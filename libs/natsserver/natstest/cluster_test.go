package natstest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// TestClusterSurvivesMemberLoss: an R3 stream on a 3-member cluster
// keeps taking writes when the member leading it dies, and the member
// comes back on its ports and store with every message, including those
// written while it was away.
func TestClusterSurvivesMemberLoss(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	opts, err := natsauth.ClientOptions(natstest.Operator(t, c))
	if err != nil {
		t.Fatal(err)
	}
	opts = append(opts, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	nc, err := nats.Connect(c.URLs(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "R3TEST", Subjects: []string{"r3.>"}, Replicas: 3})
	if err != nil {
		t.Fatalf("create R3 stream: %v", err)
	}
	if got := len(s.CachedInfo().Cluster.Replicas) + 1; got != 3 {
		t.Fatalf("stream has %d copies, want 3", got)
	}
	publish := func(i int) {
		t.Helper()
		// A publish that meets the election after the leader's death
		// fails with a timeout or no responders; the client retries as
		// the services' publisher does, bounded by ctx.
		// Each try has its own short bound: a request that went to the
		// dead member gets no answer at all.
		for {
			pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
			_, err := js.Publish(pctx, fmt.Sprintf("r3.%d", i), []byte("x"), jetstream.WithMsgID(fmt.Sprint(i)))
			pcancel()
			if err == nil {
				return
			}
			if ctx.Err() != nil {
				t.Fatalf("publish %d: %v", i, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	for i := range 10 {
		publish(i)
	}

	leader := waitFor(t, func() int { return c.StreamLeader("R3TEST") })
	c.Kill(leader)
	if c.Running(leader) {
		t.Fatal("killed member still running")
	}
	for i := 10; i < 20; i++ {
		publish(i)
	}
	if next := waitFor(t, func() int { return c.StreamLeader("R3TEST") }); next == leader {
		t.Fatalf("member %d leads the stream after its death", leader)
	}

	c.Restart(leader)
	for i := 20; i < 30; i++ {
		publish(i)
	}
	// The restarted member catches up: its own copy (the monitoring
	// view of its store, not the leader's answer) holds all 30.
	acc := c.Trust.AccountPublicKey()
	var msgs uint64
	for ctx.Err() == nil {
		jsz, err := c.Servers[leader].Jsz(&server.JSzOptions{Account: acc, Streams: true})
		if err == nil {
			for _, a := range jsz.AccountDetails {
				for _, st := range a.Streams {
					if st.Name == "R3TEST" {
						msgs = st.State.Msgs
					}
				}
			}
		}
		if msgs == 30 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if msgs != 30 {
		t.Fatalf("the restarted member's copy holds %d messages, want 30", msgs)
	}
}

// waitFor polls f (at most 30 s) until it returns an index >= 0.
func waitFor(t *testing.T, f func() int) int {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if i := f(); i >= 0 {
			return i
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Fatal("no leader within 30s")
	return -1
}
