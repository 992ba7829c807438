package fragsim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
)

// Choice is a policy's rating of one node for one request.
type Choice struct {
	// Score: higher is better. The replay takes the best; of equal best
	// scores, the first node in its (per-seed random) node order.
	Score float64
	// GPU is the device a GPU-sharing request takes; -1 otherwise (whole
	// GPUs go to the lowest-index idle devices).
	GPU int
}

// Policy rates the nodes a request fits. Score is called only with a node
// for which n.Fits(r) holds. It must not change n's capacity; the replay
// (or the scheduler) assigns the request to the chosen node afterwards.
type Policy interface {
	Name() string
	Score(n *NodeState, r Request) Choice
}

// The normalising maxima of the paper's simulator (MaxSpecCpu, MaxSpecGpu).
const (
	maxSpecCPU = 128000
	maxSpecGPU = 8000
)

// bestFitGPU is the device with the least room that still holds a
// GPU-sharing r, lowest index first; -1 for other requests.
func bestFitGPU(n *NodeState, r Request) int {
	if !r.Shares() {
		return -1
	}
	best := -1
	for g := range n.GPUs {
		if l := n.GPULeft[g]; l >= r.GPUMilli && (best < 0 || l < n.GPULeft[best]) {
			best = g
		}
	}
	return best
}

// Random places on a node drawn at random among those that fit (each node
// scores a random number, as the paper's RandomScore gives one random node
// the top score), and a GPU-sharing task on a random device with room.
type Random struct{ rng *rand.Rand }

// NewRandom returns the Random baseline drawing from rng.
func NewRandom(rng *rand.Rand) *Random { return &Random{rng: rng} }

func (*Random) Name() string { return "Random" }

func (p *Random) Score(n *NodeState, r Request) Choice {
	c := Choice{Score: p.rng.Float64(), GPU: -1}
	if r.Shares() {
		seen := 0
		for g := range n.GPUs {
			if n.GPULeft[g] >= r.GPUMilli {
				seen++
				if p.rng.IntN(seen) == 0 {
					c.GPU = g
				}
			}
		}
	}
	return c
}

// BestFit prefers the node left with the least free CPU and GPU, each
// normalised by the largest machine (the paper's BestFit).
type BestFit struct{}

func (BestFit) Name() string { return "BestFit" }

func (BestFit) Score(n *NodeState, r Request) Choice {
	waste := 0.5*float64(n.CPULeft-r.CPUMilli)/maxSpecCPU + 0.5*float64(n.GPULeftTotal()-r.TotalMilliGPU())/maxSpecGPU
	return Choice{Score: math.Trunc((1 - waste) * 100), GPU: bestFitGPU(n, r)}
}

// Packing prefers, in order: sharing devices already in use (the fuller the
// better), idle devices of a node already in use, then idle nodes (the
// paper's GPU Packing). CPU-only tasks go anywhere.
type Packing struct{}

func (Packing) Name() string { return "Packing" }

func (Packing) Score(n *NodeState, r Request) Choice {
	c := Choice{GPU: bestFitGPU(n, r)}
	if r.GPUMilli <= 0 {
		return c
	}
	free := n.WholeFree()
	if free == n.GPUs { // an idle node
		c.Score = float64(max(100/3-free, free))
		return c
	}
	// The devices the task would take, least room first.
	var left [MaxGPUsPerNode]int64
	copy(left[:], n.GPULeft[:n.GPUs])
	insertionSort(left[:n.GPUs])
	need, wholeUsed := r.GPUs, 0
	var roomUsed int64
	for _, l := range left[:n.GPUs] {
		if need == 0 {
			break
		}
		if l >= r.GPUMilli {
			need--
			if l == MilliGPU {
				wholeUsed++
			}
			roomUsed += l * 100 / MilliGPU
		}
	}
	if wholeUsed > 0 {
		c.Score = float64(max(100/2-wholeUsed, 100/3))
		return c
	}
	c.Score = float64(max(100-roomUsed/10, 100/2))
	return c
}

// DotProd prefers the node whose free (CPU, GPU) vector has the smallest
// dot product with the request, both normalised by the largest machine
// (the paper's DotProd with merged GPU dimension and max normalisation).
type DotProd struct{}

func (DotProd) Name() string { return "DotProd" }

func (DotProd) Score(n *NodeState, r Request) Choice {
	dot := float64(n.CPULeft)/maxSpecCPU*float64(r.CPUMilli)/maxSpecCPU +
		float64(n.GPULeftTotal())/maxSpecGPU*float64(r.TotalMilliGPU())/maxSpecGPU
	return Choice{Score: math.Trunc(100 * (1 - dot/2)), GPU: bestFitGPU(n, r)}
}

// FGD is Fragmentation Gradient Descent as the paper's simulator runs it:
// the node (and for a GPU-sharing task the device) whose fragmentation
// against the typical workload grows least, scored as
// trunc(100·sigmoid(−Δfrag/1000)) so that near-equal moves tie and are
// broken at random.
type FGD struct{ w *Workload }

// NewFGD measures fragmentation against w (FGDWorkloadOptions for the
// paper's setting).
func NewFGD(w *Workload) *FGD { return &FGD{w: w} }

func (*FGD) Name() string { return "FGD" }

func (p *FGD) Score(n *NodeState, r Request) Choice {
	before := p.w.Frag(n)
	if !r.Shares() {
		return Choice{Score: fgdScore(before - p.w.FragAfter(n, r, -1)), GPU: -1}
	}
	best := Choice{GPU: -1}
	for g := range n.GPUs {
		l := n.GPULeft[g]
		if l < r.GPUMilli || sameRoomBefore(n, g) {
			continue // an earlier device with the same room scores the same
		}
		s := fgdScore(before - p.w.FragAfter(n, r, g))
		if best.GPU < 0 || s > best.Score {
			best = Choice{Score: s, GPU: g}
		}
	}
	return best
}

// sameRoomBefore reports whether a lower-index device has device g's room.
func sameRoomBefore(n *NodeState, g int) bool {
	for h := range g {
		if n.GPULeft[h] == n.GPULeft[g] {
			return true
		}
	}
	return false
}

func fgdScore(delta float64) float64 {
	return math.Trunc(100 / (1 + math.Exp(-delta/1000)))
}

// PolicyNames are the policies NewPolicy builds, in report order.
var PolicyNames = []string{"random", "dotprod", "packing", "bestfit", "fgd", "fragaware"}

// NewPolicy builds the named policy for a cluster and pod list: the list is
// the typical workload of FGD and FragAware; rng feeds Random's draws.
func NewPolicy(name string, nodes []NodeSpec, pods []Pod, rng *rand.Rand) (Policy, error) {
	switch name {
	case "random":
		return NewRandom(rng), nil
	case "dotprod":
		return DotProd{}, nil
	case "packing":
		return Packing{}, nil
	case "bestfit":
		return BestFit{}, nil
	case "fgd":
		return NewFGD(NewWorkload(pods, FGDWorkloadOptions)), nil
	case "fragaware":
		return NewFragAware(nodes, pods), nil
	}
	return nil, fmt.Errorf("unknown policy %q (known: %s)", name, strings.Join(PolicyNames, ", "))
}
