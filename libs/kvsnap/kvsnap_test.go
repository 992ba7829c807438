package kvsnap_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

type env struct {
	srv *natsserver.Server
	op  *bus.Bus
}

func start(t *testing.T) *env {
	t.Helper()
	srv := natstest.Start(t)
	return &env{srv: srv, op: connectAs(t, srv, natstest.Operator(t, srv))}
}

func connectAs(t testing.TB, srv *natsserver.Server, creds string) *bus.Bus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "kvsnap-test", CredsFile: creds})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	return b
}

func bucket(t testing.TB, b *bus.Bus) jetstream.KeyValue {
	t.Helper()
	kv, err := b.KeyValue(t.Context(), contracts.BucketSnapshots)
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

func payload(n int) []byte {
	data := make([]byte, n)
	for i := range data {
		data[i] = byte(i*7 + i/251)
	}
	return data
}

func gatewayStore(kv jetstream.KeyValue) kvsnap.Store {
	return kvsnap.Store{KV: kv, HeadKey: contracts.GatewaySnapshotHeadKey(), ChunkKey: contracts.GatewaySnapshotChunkKey}
}

func readHead(t *testing.T, kv jetstream.KeyValue, key string) kvsnap.Head {
	t.Helper()
	e, err := kv.Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	var h kvsnap.Head
	if err := json.Unmarshal(e.Value(), &h); err != nil {
		t.Fatal(err)
	}
	return h
}

// TestWriteThenRead: any payload size (none, less than a chunk, chunks
// exactly, chunks and a rest) reads back as written; each write goes to
// the slot the head did not name.
func TestWriteThenRead(t *testing.T) {
	e := start(t)
	s := gatewayStore(bucket(t, e.op))
	ctx := t.Context()
	slot := -1
	for _, n := range []int{0, 1, 1000, kvsnap.ChunkBytes, 2*kvsnap.ChunkBytes + 5, 10} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			want := payload(n)
			head, err := s.Write(ctx, 0, func() ([]byte, error) { return want, nil })
			if err != nil {
				t.Fatal(err)
			}
			if head.Slot == slot {
				t.Errorf("wrote slot %d again", slot)
			}
			slot = head.Slot
			if wantChunks := max(1, (n+kvsnap.ChunkBytes-1)/kvsnap.ChunkBytes); head.Chunks != wantChunks {
				t.Errorf("%d chunks, want %d", head.Chunks, wantChunks)
			}
			got, read, err := s.Read(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("read %d bytes, not the %d written", len(got), n)
			}
			if read.Slot != head.Slot || read.SHA256 != head.SHA256 {
				t.Errorf("read head %+v, wrote %+v", read, head)
			}
		})
	}
}

// TestUnreadableSnapshots: every way a snapshot can be damaged is an
// error the caller can tell (ErrNone, ErrBad), never a wrong payload.
func TestUnreadableSnapshots(t *testing.T) {
	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T, s kvsnap.Store, head kvsnap.Head)
		want  error
	}{
		{"missing", func(t *testing.T, s kvsnap.Store, _ kvsnap.Head) {
			if err := s.KV.Delete(t.Context(), s.HeadKey); err != nil {
				t.Fatal(err)
			}
		}, kvsnap.ErrNone},
		{"garbled head", func(t *testing.T, s kvsnap.Store, _ kvsnap.Head) { put(t, s.KV, s.HeadKey, []byte("{")) }, kvsnap.ErrBad},
		{"head without checksum", func(t *testing.T, s kvsnap.Store, h kvsnap.Head) {
			h.SHA256 = ""
			putHead(t, s, h)
		}, kvsnap.ErrBad},
		{"head names another slot", func(t *testing.T, s kvsnap.Store, h kvsnap.Head) {
			h.Slot = 2
			putHead(t, s, h)
		}, kvsnap.ErrBad},
		{"chunk missing", func(t *testing.T, s kvsnap.Store, h kvsnap.Head) {
			if err := s.KV.Delete(t.Context(), s.ChunkKey(h.Slot, 1)); err != nil {
				t.Fatal(err)
			}
		}, kvsnap.ErrBad},
		{"more chunks than written", func(t *testing.T, s kvsnap.Store, h kvsnap.Head) {
			h.Chunks++
			putHead(t, s, h)
		}, kvsnap.ErrBad},
		{"truncated chunk", func(t *testing.T, s kvsnap.Store, h kvsnap.Head) {
			put(t, s.KV, s.ChunkKey(h.Slot, 1), payload(10))
		}, kvsnap.ErrBad},
		{"corrupt chunk", func(t *testing.T, s kvsnap.Store, h kvsnap.Head) {
			c := payload(kvsnap.ChunkBytes)
			c[100] ^= 0x40
			put(t, s.KV, s.ChunkKey(h.Slot, 0), c)
		}, kvsnap.ErrBad},
		{"longer chunk", func(t *testing.T, s kvsnap.Store, h kvsnap.Head) {
			put(t, s.KV, s.ChunkKey(h.Slot, 1), payload(500))
		}, kvsnap.ErrBad},
		{"the next one half written", func(t *testing.T, s kvsnap.Store, h kvsnap.Head) {
			put(t, s.KV, s.ChunkKey(1-h.Slot, 0), []byte("half"))
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := start(t)
			s := gatewayStore(bucket(t, e.op))
			want := payload(kvsnap.ChunkBytes + 100)
			head, err := s.Write(t.Context(), 0, func() ([]byte, error) { return want, nil })
			if err != nil {
				t.Fatal(err)
			}
			tc.spoil(t, s, head)
			got, _, err := s.Read(t.Context())
			if tc.want == nil {
				if err != nil || !bytes.Equal(got, want) {
					t.Fatalf("the snapshot does not read back whole: %v", err)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("read: %v, want %v", err, tc.want)
			}
			if got != nil {
				t.Fatal("a payload came with the error")
			}
		})
	}
}

func put(t *testing.T, kv jetstream.KeyValue, key string, v []byte) {
	t.Helper()
	if _, err := kv.Put(t.Context(), key, v); err != nil {
		t.Fatal(err)
	}
}

func putHead(t *testing.T, s kvsnap.Store, h kvsnap.Head) {
	t.Helper()
	b, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	put(t, s.KV, s.HeadKey, b)
}

// TestCompareAndSet: writers sharing keys skip a snapshot that would not
// go further than the head's, and do not switch a head another switched
// since they read it; without CompareAndSet the last write wins.
func TestCompareAndSet(t *testing.T) {
	e := start(t)
	kv := bucket(t, e.op)
	ctx := t.Context()
	s := gatewayStore(kv)
	s.CompareAndSet = true
	one := func() ([]byte, error) { return []byte("one"), nil }
	if _, err := s.Write(ctx, 10, one); err != nil {
		t.Fatal(err)
	}
	for _, seq := range []uint64{5, 10} {
		called := false
		_, err := s.Write(ctx, seq, func() ([]byte, error) { called = true; return []byte("older"), nil })
		if !errors.Is(err, kvsnap.ErrSuperseded) {
			t.Errorf("seq %d after 10: %v, want ErrSuperseded", seq, err)
		}
		if called {
			t.Errorf("seq %d after 10: the payload was encoded", seq)
		}
	}
	// Another writer switches the head while this one encodes: to a
	// later position (this one is skipped, the other's slot kept whole),
	// then to an earlier one (this one goes on, into the other slot).
	for _, tc := range []struct {
		other, this uint64
		want        string
	}{{25, 20, "other"}, {30, 40, "this"}} {
		_, err := s.Write(ctx, tc.this, func() ([]byte, error) {
			if _, err := s.Write(ctx, tc.other, func() ([]byte, error) { return []byte("other"), nil }); err != nil {
				t.Fatal(err)
			}
			return []byte("this"), nil
		})
		if tc.want == "other" && !errors.Is(err, kvsnap.ErrSuperseded) || tc.want == "this" && err != nil {
			t.Errorf("%d switched while %d was encoded: %v", tc.other, tc.this, err)
		}
		if got, _, err := s.Read(ctx); err != nil || string(got) != tc.want {
			t.Errorf("%d switched while %d was encoded: read %q (%v), want %q", tc.other, tc.this, got, err, tc.want)
		}
	}
	// A head switched between the look and the switch: Update refuses it.
	e0, err := kv.Get(ctx, s.HeadKey)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Write(ctx, 50, one); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Update(ctx, s.HeadKey, e0.Value(), e0.Revision()); !errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		t.Errorf("an update at an old revision: %v, want ErrKeyRevisionMismatch (what Write maps to ErrSuperseded)", err)
	}
	s.CompareAndSet = false
	if _, err := s.Write(ctx, 1, func() ([]byte, error) { return []byte("last"), nil }); err != nil {
		t.Fatal(err)
	}
	if got, _, err := s.Read(ctx); err != nil || string(got) != "last" {
		t.Errorf("read %q (%v), want the last write", got, err)
	}
}

// TestEachServiceWritesItsOwnKeys: the key layouts the services use stay
// within contracts/access.go's grants (the scheduler its keys, the
// resource manager resource-manager.>, the gateway gateway.>).
func TestEachServiceWritesItsOwnKeys(t *testing.T) {
	e := start(t)
	bucket(t, e.op) // provisioned by the operator
	for _, tc := range []struct {
		role  contracts.BusRole
		store func(kv jetstream.KeyValue) kvsnap.Store
	}{
		{contracts.BusScheduler, func(kv jetstream.KeyValue) kvsnap.Store {
			return kvsnap.Store{KV: kv, HeadKey: contracts.SnapshotHeadKey("s1"),
				ChunkKey: func(slot, i int) string { return contracts.SnapshotChunkKey("s1", slot, i) }}
		}},
		{contracts.BusResourceManager, func(kv jetstream.KeyValue) kvsnap.Store {
			return kvsnap.Store{KV: kv, HeadKey: contracts.RMSnapshotHeadKey(), ChunkKey: contracts.RMSnapshotChunkKey}
		}},
		{contracts.BusGateway, func(kv jetstream.KeyValue) kvsnap.Store {
			s := gatewayStore(kv)
			s.CompareAndSet = true
			return s
		}},
	} {
		t.Run(string(tc.role), func(t *testing.T) {
			b := connectAs(t, e.srv, natstest.Service(t, e.srv, tc.role))
			s := tc.store(bucket(t, b))
			want := payload(kvsnap.ChunkBytes + 1)
			for seq := uint64(1); seq <= 2; seq++ { // both slots
				if _, err := s.Write(t.Context(), seq, func() ([]byte, error) { return want, nil }); err != nil {
					t.Fatal(err)
				}
			}
			if got, _, err := s.Read(t.Context()); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("read back: %v", err)
			}
		})
	}
}

// TestLivesAndStale: a stream's life changes when it is recreated, and a
// snapshot of the old life, or ahead of the stream, is stale.
func TestLivesAndStale(t *testing.T) {
	e := start(t)
	ctx := t.Context()
	if err := e.op.EnsureStreams(ctx); err != nil {
		t.Fatal(err)
	}
	js := e.op.JetStream()
	stream := contracts.StreamJobs
	for range 3 {
		if _, err := js.Publish(ctx, contracts.SubjectSubmit("acme"), []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
	}
	lives, err := kvsnap.Lives(ctx, js, stream)
	if err != nil {
		t.Fatal(err)
	}
	l := lives[stream]
	if l.First != 1 || l.Last != 3 || l.Created == "" {
		t.Fatalf("life %+v, want 1 to 3 and a creation time", l)
	}
	created := kvsnap.Created(lives)
	if err := kvsnap.Recreated(created, lives); err != nil {
		t.Errorf("the same life: %v", err)
	}
	for _, tc := range []struct {
		name    string
		created string
		seq     uint64
		want    error
	}{
		{"covers all", l.Created, 3, nil},
		{"covers part", l.Created, 1, nil},
		{"covers nothing", l.Created, 0, nil},
		{"ahead", l.Created, 4, kvsnap.ErrStale},
		{"another life", "2020-01-01T00:00:00Z", 1, kvsnap.ErrStale},
	} {
		if err := kvsnap.Stale(stream, l, tc.created, tc.seq); !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	if err := js.DeleteStream(ctx, stream); err != nil {
		t.Fatal(err)
	}
	if err := e.op.EnsureStreams(ctx); err != nil {
		t.Fatal(err)
	}
	again, err := kvsnap.Lives(ctx, js, stream)
	if err != nil {
		t.Fatal(err)
	}
	if err := kvsnap.Recreated(created, again); !errors.Is(err, kvsnap.ErrRecreated) {
		t.Errorf("recreated stream: %v, want ErrRecreated", err)
	}
	if err := kvsnap.Stale(stream, again[stream], l.Created, 0); !errors.Is(err, kvsnap.ErrStale) {
		t.Errorf("a snapshot of the old life: %v, want ErrStale", err)
	}
	if _, err := kvsnap.Lives(ctx, js, "NO_SUCH_STREAM"); err == nil {
		t.Error("a missing stream has a life")
	}
}
