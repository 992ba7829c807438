package bus_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// TestOperatorUpdatesOnlyWhatDrifted: an operator that connects to a bus
// already at contracts' config sends no stream update at all (on file and
// memory storage, and at R3 on a cluster), and one that finds streams and
// buckets edited by hand puts exactly those back.
func TestOperatorUpdatesOnlyWhatDrifted(t *testing.T) {
	for _, tc := range []struct {
		name    string
		members int
		opts    contracts.StreamOptions
	}{
		{"file", 1, contracts.StreamOptions{}},
		{"memory", 1, contracts.StreamOptions{Memory: true}},
		{"R3 cluster", 3, contracts.StreamOptions{Replicas: 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var url, creds string
			if tc.members == 1 {
				srv := natstest.Start(t)
				url, creds = srv.URL(), natstest.Operator(t, srv)
			} else {
				c := natstest.StartCluster(t, tc.members)
				url, creds = c.URLs(), natstest.Operator(t, c)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			opts := tc.opts
			connect := func() *bus.Bus {
				t.Helper()
				b, err := bus.Connect(ctx, bus.Config{URL: url, Name: "operator", CredsFile: creds, Streams: opts})
				if err != nil {
					t.Fatalf("operator connect: %v", err)
				}
				for _, kv := range contracts.KeyValues(opts) {
					if _, err := b.KeyValue(ctx, kv.Bucket); err != nil {
						t.Fatalf("bucket %s: %v", kv.Bucket, err)
					}
				}
				return b
			}
			first := connect()
			defer first.Close(context.Background())

			var mu sync.Mutex
			var updated []string
			sub, err := first.Conn().Subscribe("$JS.EVENT.ADVISORY.STREAM.UPDATED.*", func(m *nats.Msg) {
				mu.Lock()
				defer mu.Unlock()
				updated = append(updated, m.Subject[strings.LastIndexByte(m.Subject, '.')+1:])
			})
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Unsubscribe()
			if err := first.Conn().Flush(); err != nil {
				t.Fatal(err)
			}
			// updates returns the streams updated since the last call once
			// n advisories arrived (or 5 s passed), and a moment after, for
			// an advisory sent by another cluster member to arrive too.
			updates := func(n int) []string {
				deadline := time.Now().Add(5 * time.Second)
				for {
					mu.Lock()
					got := len(updated)
					mu.Unlock()
					if got >= n || time.Now().After(deadline) {
						break
					}
					time.Sleep(10 * time.Millisecond)
				}
				time.Sleep(200 * time.Millisecond)
				mu.Lock()
				defer mu.Unlock()
				out := slices.Clone(updated)
				updated = nil
				slices.Sort(out)
				return out
			}

			again := connect()
			again.Close(context.Background())
			if u := updates(0); len(u) > 0 {
				t.Errorf("an operator connecting to streams at their contract updated %v, want none", u)
			}

			js := first.JetStream()
			s, err := js.Stream(ctx, contracts.StreamJobs)
			if err != nil {
				t.Fatal(err)
			}
			// Hand edits, each on its own stream: JOBS, and the backing
			// streams of buckets, where an edit can leave no valid bucket
			// to nats.go (unlimited history) or break one in ways a
			// bucket's status does not show (a review of the first
			// version, which compared statuses, found each of these).
			kvs := contracts.KeyValues(opts)
			edits := map[string]func(*jetstream.StreamConfig){
				contracts.StreamJobs:  func(c *jetstream.StreamConfig) { c.MaxAge, c.Description = time.Hour, "edited by hand" },
				"KV_" + kvs[0].Bucket: func(c *jetstream.StreamConfig) { c.MaxMsgsPerSubject = 2 },
				"KV_" + kvs[1].Bucket: func(c *jetstream.StreamConfig) { c.MaxMsgsPerSubject = -1 },
				"KV_" + kvs[2].Bucket: func(c *jetstream.StreamConfig) { c.MaxMsgs = 5 },
				"KV_" + kvs[3].Bucket: func(c *jetstream.StreamConfig) { c.AllowRollup = false },
				"KV_" + kvs[4].Bucket: func(c *jetstream.StreamConfig) { c.AllowDirect = false },
				"KV_" + kvs[5].Bucket: func(c *jetstream.StreamConfig) { c.MaxConsumers = 1 },
				"KV_" + kvs[6].Bucket: func(c *jetstream.StreamConfig) { c.Discard = jetstream.DiscardOld },
				"KV_" + kvs[7].Bucket: func(c *jetstream.StreamConfig) { c.Subjects = append(c.Subjects, "gp-test.extra.>") },
				"KV_" + kvs[8].Bucket: func(c *jetstream.StreamConfig) { c.MaxMsgsPerSubject = 257 },
			}
			var edited []string
			for name, edit := range edits {
				es, err := js.Stream(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				cfg := es.CachedInfo().Config
				edit(&cfg)
				if _, err := js.UpdateStream(ctx, cfg); err != nil {
					t.Fatalf("hand edit of %s: %v", name, err)
				}
				edited = append(edited, name)
			}
			slices.Sort(edited)
			updates(len(edited))

			third := connect()
			third.Close(context.Background())
			if u := updates(len(edited)); !slices.Equal(u, edited) {
				t.Errorf("after hand edits the operator updated %v, want %v", u, edited)
			}
			fourth := connect()
			fourth.Close(context.Background())
			if u := updates(0); len(u) > 0 {
				t.Errorf("the operator's updates left %v off contract: the next connect updated them again", u)
			}
			info, err := s.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if want := contracts.Streams(opts)[0]; info.Config.MaxAge != 0 || info.Config.Description != want.Description {
				t.Errorf("JOBS after the operator connected: max age %v, description %q; want 0, %q", info.Config.MaxAge, info.Config.Description, want.Description)
			}
			for _, kv := range kvs[:2] {
				b, err := js.KeyValue(ctx, kv.Bucket)
				if err != nil {
					t.Fatalf("bucket %s after the operator connected: %v", kv.Bucket, err)
				}
				st, err := b.Status(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if st.History() != int64(kv.History) {
					t.Errorf("bucket %s history %d after the operator connected, want %d", kv.Bucket, st.History(), kv.History)
				}
			}
		})
	}
}
