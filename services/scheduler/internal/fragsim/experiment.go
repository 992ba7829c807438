package fragsim

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Experiment replays one pod list with several policies and seeds under
// the same protocol: for a given seed every policy sees the same task
// sequence and the same node order.
type Experiment struct {
	Nodes     []NodeSpec
	Pods      []Pod
	Policies  []string
	Seeds     []uint64
	Inflation float64
	// Parallel replays run at once (at least 1).
	Parallel int
}

// PolicyRuns are one policy's replays, by seed.
type PolicyRuns struct {
	Policy string
	Runs   []*Result
}

// Median is the median unallocated GPU % at x% arrived over the runs.
func (p PolicyRuns) Median(x float64) float64 {
	vals := make([]float64, 0, len(p.Runs))
	for _, r := range p.Runs {
		vals = append(vals, r.Curve.Unallocated(x))
	}
	return Median(vals)
}

// MeanElapsed is the mean time of one replay.
func (p PolicyRuns) MeanElapsed() time.Duration {
	var t time.Duration
	for _, r := range p.Runs {
		t += r.Elapsed
	}
	return t / time.Duration(max(len(p.Runs), 1))
}

// Median of vals (the mean of the middle two for an even count); NaN for
// none. NaN values sort first and so count as missing only when most are.
func Median(vals []float64) float64 {
	if len(vals) == 0 {
		return math.NaN()
	}
	v := slices.Clone(vals)
	slices.Sort(v)
	m := len(v) / 2
	if len(v)%2 == 1 {
		return v[m]
	}
	return (v[m-1] + v[m]) / 2
}

// Streams of independent generators derived from one seed: the task
// sequence, the node order and a policy's own draws.
const (
	streamSequence = 0x5eed_0001
	streamNodes    = 0x5eed_0002
	streamPolicy   = 0x5eed_0003
)

// Run replays every (policy, seed) pair.
func (e *Experiment) Run(ctx context.Context) ([]PolicyRuns, error) {
	if e.Inflation <= 0 {
		return nil, fmt.Errorf("inflation %.2f must be positive", e.Inflation)
	}
	if len(e.Seeds) == 0 || len(e.Policies) == 0 {
		return nil, fmt.Errorf("need at least one seed and one policy")
	}
	for _, name := range e.Policies {
		if _, err := NewPolicy(name, e.Nodes, e.Pods, rand.New(rand.NewPCG(0, 0))); err != nil {
			return nil, err
		}
	}
	capacity := GPUCapacity(e.Nodes)
	seqs := make([][]Pod, len(e.Seeds))
	for i, s := range e.Seeds {
		seqs[i] = Sequence(e.Pods, capacity, e.Inflation, rand.New(rand.NewPCG(s, streamSequence)))
	}
	out := make([]PolicyRuns, len(e.Policies))
	type job struct{ p, s int }
	jobs := make(chan job)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for range max(e.Parallel, 1) {
		wg.Go(func() {
			for j := range jobs {
				seed := e.Seeds[j.s]
				pol, err := NewPolicy(e.Policies[j.p], e.Nodes, e.Pods, rand.New(rand.NewPCG(seed, streamPolicy)))
				var res *Result
				if err == nil {
					res, err = Replay(e.Nodes, seqs[j.s], pol, rand.New(rand.NewPCG(seed, streamNodes)))
				}
				if res != nil {
					res.Cluster = nil // the curve is what is kept
				}
				mu.Lock()
				if err != nil && first == nil {
					first = err
				}
				out[j.p].Runs[j.s] = res
				mu.Unlock()
			}
		})
	}
	for p, name := range e.Policies {
		out[p] = PolicyRuns{Policy: name, Runs: make([]*Result, len(e.Seeds))}
	}
feed:
	for p := range e.Policies {
		for s := range e.Seeds {
			select {
			case jobs <- job{p, s}:
			case <-ctx.Done():
				break feed
			}
		}
	}
	close(jobs)
	wg.Wait()
	if first != nil {
		return nil, first
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// Above lists the arrival points (whole percents from 1 to maxPct) at
// which a's median unallocated share is above b's: where policy a
// refused more than b by then. Points that either never reached are
// skipped.
func Above(a, b PolicyRuns, maxPct int) []float64 {
	var out []float64
	for x := 1; x <= maxPct; x++ {
		ma, mb := a.Median(float64(x)), b.Median(float64(x))
		if math.IsNaN(ma) || math.IsNaN(mb) {
			continue
		}
		if ma > mb {
			out = append(out, float64(x))
		}
	}
	return out
}
