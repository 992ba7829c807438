package bus_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// TestLeaderReads: LeaderLast and LeaderNext answer what the stream holds,
// by subject filter, sequence and time, and 0 where it holds nothing.
// (Through each member of a cluster: the gateway's
// TestLeaderReadsOnACluster.)
func TestLeaderReads(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	seqs := map[string][]uint64{}
	var mid time.Time
	for i := range 6 {
		tenant := []string{"acme", "globex"}[i%2]
		if i == 4 {
			time.Sleep(20 * time.Millisecond) // stored times are the server's: a clear gap
			mid = time.Now()
			time.Sleep(20 * time.Millisecond)
		}
		ack, err := b.Publish(ctx, contracts.SubjectCancel(tenant), fmt.Sprintf("c%d", i), contracts.CancelRequest{JobID: fmt.Sprintf("j%d", i)})
		if err != nil {
			t.Fatal(err)
		}
		seqs[tenant] = append(seqs[tenant], ack.Sequence)
	}
	acme, globex := contracts.SubjectCancel("acme"), contracts.SubjectCancel("globex")
	nobody := contracts.SubjectCancel("initech")
	last := func(subjects ...string) uint64 {
		n, err := bus.LeaderLast(ctx, b.Conn(), contracts.StreamJobs, subjects)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	next := func(seq uint64, since time.Time, subjects ...string) uint64 {
		n, err := bus.LeaderNext(ctx, b.Conn(), contracts.StreamJobs, subjects, seq, since)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, c := range []struct {
		name      string
		got, want uint64
	}{
		{"last of acme", last(acme), seqs["acme"][2]},
		{"last of globex", last(globex), seqs["globex"][2]},
		{"last of both", last(acme, globex), seqs["globex"][2]},
		{"last of all", last(), seqs["globex"][2]},
		{"last of none", last(nobody), 0},
		{"next of acme from its second", next(seqs["acme"][1], time.Time{}, acme), seqs["acme"][1]},
		{"next of acme past its second", next(seqs["acme"][1]+1, time.Time{}, acme), seqs["acme"][2]},
		{"next of acme past its last", next(seqs["acme"][2]+1, time.Time{}, acme), 0},
		{"next of both past acme's first", next(seqs["acme"][0]+1, time.Time{}, acme, globex), seqs["globex"][0]},
		{"next of all since the gap", next(0, mid), seqs["acme"][2]},
		{"next of globex since the gap", next(0, mid, globex), seqs["globex"][2]},
		{"next of none", next(1, time.Time{}, nobody), 0},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
}
