package bus_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// TestOperatorUpdatesOnlyWhatDrifted: an operator that connects to a bus
// already at contracts' config sends no stream update at all (on file and
// memory storage, and at R3 on a cluster), and one that finds a stream and a bucket edited by hand
// puts those two back, and nothing else.
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
			edited := s.CachedInfo().Config
			edited.MaxAge, edited.Description = time.Hour, "edited by hand"
			if _, err := js.UpdateStream(ctx, edited); err != nil {
				t.Fatal(err)
			}
			kvCfg := contracts.KeyValues(opts)[0]
			handKV := kvCfg
			handKV.History = 2
			if _, err := js.UpdateKeyValue(ctx, handKV); err != nil {
				t.Fatal(err)
			}
			updates(2)

			third := connect()
			third.Close(context.Background())
			if u, want := updates(2), []string{contracts.StreamJobs, "KV_" + kvCfg.Bucket}; !slices.Equal(u, want) {
				t.Errorf("after hand edits the operator updated %v, want %v", u, want)
			}
			info, err := s.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if want := contracts.Streams(opts)[0]; info.Config.MaxAge != 0 || info.Config.Description != want.Description {
				t.Errorf("JOBS after the operator connected: max age %v, description %q; want 0, %q", info.Config.MaxAge, info.Config.Description, want.Description)
			}
			kv, err := js.KeyValue(ctx, kvCfg.Bucket)
			if err != nil {
				t.Fatal(err)
			}
			st, err := kv.Status(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if st.History() != int64(kvCfg.History) {
				t.Errorf("bucket %s history %d after the operator connected, want %d", kvCfg.Bucket, st.History(), kvCfg.History)
			}
		})
	}
}
