package placement

import (
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestPendingCodesNameTheRealCause is issue 18's "codes are swapped":
// reserved_for_job_ahead only where a reservation is what keeps a job
// waiting, insufficient_free_gpus where it would not fit even without one,
// and unsatisfiable at once where no machine's host could ever hold it.
// Reservations are given both ways a caller may: whole nodes (Exclude) and
// device holds (Reserved).
func TestPendingCodesNameTheRealCause(t *testing.T) {
	holdAll := func(n Node) Hold {
		h := Hold{SpareCPUMilli: 1 << 40, SpareMemoryMiB: 1 << 40}
		for _, g := range n.GPUs {
			h.Devices = append(h.Devices, ref(&g))
		}
		return h
	}
	free8, free6, full := mk("a-free8", "p", 8, 0), mk("b-free6", "p", 8, 2), mk("c-full", "p", 8, 8)
	host := func(n Node, cpu int64) Node { n.CPUMilliCapacity, n.CPUMilliFree = cpu, cpu; return n }
	tests := map[string]struct {
		nodes    []Node
		req      Request
		exclude  []string
		reserved []string
		want     contracts.Reason
		contains string
	}{
		"8 free but reserved, 6 free elsewhere (Exclude)": {
			nodes: []Node{free8, free6}, req: whole(8), exclude: []string{"a-free8"},
			want: contracts.PendingReservedForOther, contains: "1 machine that could take it now is reserved for jobs ahead"},
		"8 free but reserved, 6 free elsewhere (holds)": {
			nodes: []Node{free8, free6}, req: whole(8), reserved: []string{"a-free8"},
			want: contracts.PendingReservedForOther, contains: "reserved for jobs ahead"},
		"the reserved machine is full anyway (Exclude)": {
			nodes: []Node{full}, req: whole(1), exclude: []string{"c-full"},
			want: contracts.PendingInsufficientGPUs, contains: "no matching GPU is free"},
		"the reserved machine is full anyway (holds)": {
			nodes: []Node{full}, req: whole(1), reserved: []string{"c-full"},
			want: contracts.PendingInsufficientGPUs, contains: "no matching GPU is free"},
		"too small everywhere, one machine reserved": {
			nodes: []Node{free6, full}, req: whole(8), exclude: []string{"c-full"},
			want: contracts.PendingInsufficientGPUs, contains: "largest free block is 6"},
		"100 cores on 48-core hosts": {
			nodes: []Node{host(free8, 48_000), host(free6, 48_000)}, req: Request{GPU: contracts.GPURequest{Count: 1}, CPUMilli: 100_000},
			want: contracts.ReasonUnsatisfiable, contains: "the most any has is 48000 milli-CPU"},
		"100 cores, one host does not report its CPUs": {
			nodes: []Node{host(free8, 48_000), free6}, req: Request{GPU: contracts.GPURequest{Count: 1}, CPUMilli: 100_000},
			want: contracts.PendingNoSchedulableNode},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			r := tc.req
			for _, id := range tc.exclude {
				if r.Exclude == nil {
					r.Exclude = map[string]bool{}
				}
				r.Exclude[id] = true
			}
			for _, id := range tc.reserved {
				if r.Reserved == nil {
					r.Reserved = map[string]Hold{}
				}
				for _, n := range tc.nodes {
					if n.ID == id {
						r.Reserved[id] = holdAll(n)
					}
				}
			}
			d := NewPlacer(Snapshot{Nodes: tc.nodes}, Options{}).Place(r)
			if d.Placed() {
				t.Fatalf("placed %s", placed(d))
			}
			if d.Pending.Code != tc.want || !strings.Contains(d.Pending.Message, tc.contains) {
				t.Errorf("pending %s: %s\nwant %s containing %q", d.Pending.Code, d.Pending.Message, tc.want, tc.contains)
			}
		})
	}
}

// TestHeldNodesKeepOnlyTheHeldDevices: a request may use what a hold
// leaves on a node (the cards, MIG instances and host capacity not held),
// and nothing held.
func TestHeldNodesKeepOnlyTheHeldDevices(t *testing.T) {
	n := mk("n1", "p", 4, 0)
	n.GPUs = append(n.GPUs, migGPU("n1", 4, []string{"1g.10gb", "1g.10gb"}, []int{0, 1}))
	hold := Hold{Devices: []contracts.DeviceRef{ref(&n.GPUs[0]), ref(&n.GPUs[1]), ref(&n.GPUs[2])},
		SpareCPUMilli: 8000, SpareMemoryMiB: 1 << 20}
	in := n.GPUs[4].Instances[0].Instance
	migRef := ref(&n.GPUs[4])
	migRef.MIG = &in
	hold.Devices = append(hold.Devices, migRef)
	tests := map[string]struct {
		reqs []Request
		want []string
	}{
		"the card not held, then nothing": {[]Request{whole(1), whole(1)}, []string{"n1[3]", string(contracts.PendingReservedForOther)}},
		"two cards: one is held":          {[]Request{whole(2)}, []string{string(contracts.PendingReservedForOther)}},
		"the MIG instance not held":       {[]Request{mig("1g.10gb"), mig("1g.10gb")}, []string{"n1[4:1g.10gb@1]", string(contracts.PendingReservedForOther)}},
		"host CPU within the spare only":  {[]Request{{GPU: contracts.GPURequest{Count: 1}, CPUMilli: 9000}}, []string{string(contracts.PendingReservedForOther)}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			p := NewPlacer(Snapshot{Nodes: []Node{n}}, Options{})
			for i, r := range tc.reqs {
				r.Reserved = map[string]Hold{"n1": hold}
				if got := placed(p.Place(r)); got != tc.want[i] {
					t.Errorf("request %d: %s, want %s", i, got, tc.want[i])
				}
			}
		})
	}
}
