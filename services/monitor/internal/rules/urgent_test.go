package rules

import (
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// A sample that newly meets an instant rule (gpu_hot, gpu_xid, ...) asks
// for an evaluation at once; one that meets only a rule with a hold time,
// or an instant rule already firing, does not.
func TestInstantRulesSignalUrgent(t *testing.T) {
	e, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 11, 22, 8, 0, 0, 0, time.UTC)
	m := Machine{Node: "n1", Pool: "p"}
	sample := func(mut func(*contracts.GPUSample)) []contracts.GPUSample {
		s := contracts.GPUSample{UUID: "G1", Model: "H100-80GB", Healthy: true, FBFreeMiB: 80000, TempC: 50, GPUUtil: 10}
		mut(&s)
		return []contracts.GPUSample{s}
	}
	urgent := func() bool {
		select {
		case <-e.Urgent():
			return true
		default:
			return false
		}
	}
	steps := []struct {
		name string
		mut  func(*contracts.GPUSample)
		eval bool
		want bool
	}{
		{"cool", func(*contracts.GPUSample) {}, false, false},
		// GPU memory above 90% holds for a minute before it fires: no hurry.
		{"memory full", func(s *contracts.GPUSample) { s.FBUsedMiB, s.FBFreeMiB = 79000, 1000 }, false, false},
		{"hot", func(s *contracts.GPUSample) { s.TempC = 90 }, true, true},
		{"still hot, firing", func(s *contracts.GPUSample) { s.TempC = 91 }, false, false},
		{"xid while hot", func(s *contracts.GPUSample) { s.TempC, s.LastXID = 91, 79 }, false, true},
	}
	for i, st := range steps {
		e.Ingest(m, at.Add(time.Duration(i)*time.Second), sample(st.mut), nil)
		if got := urgent(); got != st.want {
			t.Fatalf("%s: urgent %v, want %v", st.name, got, st.want)
		}
		if st.eval {
			trs := e.Evaluate(at.Add(time.Duration(i) * time.Second))
			if len(trs) != 1 || trs[0].Kind != "gpu_hot" || trs[0].State != contracts.AlertFiring {
				t.Fatalf("%s: transitions %+v", st.name, trs)
			}
		}
	}
}
