package contracts

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// MIG geometry. Every MIG-capable model listed here (A100, H100, H200) has
// 7 compute slices (GPCs) and 8 memory slices. A GPU instance occupies
// MIGProfile.MemorySlices contiguous memory slices from its start, which
// must be one of the profile's allowed starts: that is the placement
// `nvidia-smi mig -lgipp` lists ("{0,2,4}:2") and `nvidia-smi mig -lgi`
// shows as Start:Size. Two instances of a GPU never share a memory slice.
const (
	MIGComputeSlices = 7
	MIGMemorySlices  = 8
)

// MIGProfile is one GPU instance profile of a model, as `nvidia-smi mig
// -lgip` and `-lgipp` print it. The resource manager and the scheduler
// validate MIG placements against the same table the simulated agent
// builds its MIG devices from.
type MIGProfile struct {
	// Name is the profile's name without "MIG " ("3g.40gb").
	Name string `json:"name"`
	// ProfileID is NVML's GPU instance profile ID (the ID column of
	// nvidia-smi mig -lgip; what nvidia-smi mig -cgi takes).
	ProfileID int `json:"profileId"`
	// ComputeSlices is the g of the name: sevenths of the GPU's SMs.
	ComputeSlices int `json:"computeSlices"`
	// MemorySlices is the size of a placement, in eighths of the memory.
	MemorySlices int `json:"memorySlices"`
	// MemoryMiB is the instance's framebuffer as nvidia-smi mig -lgip
	// reports it (GiB there, MiB here).
	MemoryMiB int64 `json:"memoryMiB"`
	// MaxInstances is how many instances of this profile alone fit a GPU
	// (the Total of -lgip's Free/Total).
	MaxInstances int `json:"maxInstances"`
	// Starts are the memory slices a placement may start at.
	Starts []int `json:"starts"`
}

// MIGPlacement is one GPU instance of a profile at a start slice.
type MIGPlacement struct {
	Profile string `json:"profile"`
	Start   int    `json:"start"`
}

func (p MIGPlacement) String() string { return fmt.Sprintf("%s@%d", p.Profile, p.Start) }

// Placement is where the MIG instance sits on its GPU.
func (m MIGInstance) Placement() MIGPlacement {
	return MIGPlacement{Profile: m.Profile, Start: m.Start}
}

// The placement starts shared by the A100, H100 and H200 profile shapes
// (nvidia-smi mig -lgipp, identical on the three).
var (
	migStarts1  = []int{0, 1, 2, 3, 4, 5, 6} // 1g, size 1
	migStarts2  = []int{0, 2, 4, 6}          // 1g with double memory, size 2
	migStarts2g = []int{0, 2, 4}             // 2g, size 2
	migStarts3g = []int{0, 4}                // 3g, size 4
	migStarts0  = []int{0}                   // 4g (size 4) and 7g (size 8)
)

// migShape builds a model's six profiles from its names and memory sizes,
// in the order nvidia-smi mig -lgip prints them (without the +me media
// extension profiles, which take the same placements as the 1g profile).
func migShape(names [6]string, mib [6]int64) []MIGProfile {
	return []MIGProfile{
		{Name: names[0], ProfileID: 19, ComputeSlices: 1, MemorySlices: 1, MemoryMiB: mib[0], MaxInstances: 7, Starts: migStarts1},
		{Name: names[1], ProfileID: 15, ComputeSlices: 1, MemorySlices: 2, MemoryMiB: mib[1], MaxInstances: 4, Starts: migStarts2},
		{Name: names[2], ProfileID: 14, ComputeSlices: 2, MemorySlices: 2, MemoryMiB: mib[2], MaxInstances: 3, Starts: migStarts2g},
		{Name: names[3], ProfileID: 9, ComputeSlices: 3, MemorySlices: 4, MemoryMiB: mib[3], MaxInstances: 2, Starts: migStarts3g},
		{Name: names[4], ProfileID: 5, ComputeSlices: 4, MemorySlices: 4, MemoryMiB: mib[4], MaxInstances: 1, Starts: migStarts0},
		{Name: names[5], ProfileID: 0, ComputeSlices: 7, MemorySlices: 8, MemoryMiB: mib[5], MaxInstances: 1, Starts: migStarts0},
	}
}

// migProfiles holds the MIG-capable models of GPUModels. Sources: NVIDIA's
// MIG user guide ("Supported MIG Profiles": names, instance counts,
// fractions) and nvidia-smi mig -lgip/-lgipp output (memory, placements;
// memory sizes move by a fraction of a GiB between driver releases).
// A100 40GB memory is the go-nvml dgxa100 mock's (4.75/9.62/19.50/39.25
// GiB); H100 80GB is 9.75/19.62/39.50/79.25 GiB. H200's 1g.18gb shows
// 16.00 GiB; its larger profiles are scaled from it as H100's are from
// its 1g.10gb.
var migProfiles = map[string][]MIGProfile{
	"A100-40GB": migShape(
		[6]string{"1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"},
		[6]int64{4864, 9856, 9856, 19968, 19968, 40192}),
	"A100-80GB": migShape(
		[6]string{"1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
		[6]int64{9728, 19968, 19968, 40192, 40192, 80896}),
	"H100-80GB": migShape(
		[6]string{"1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
		[6]int64{9984, 20096, 20096, 40448, 40448, 81152}),
	"H100-80GB-PCIE": migShape(
		[6]string{"1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
		[6]int64{9984, 20096, 20096, 40448, 40448, 81152}),
	"H200-141GB": migShape(
		[6]string{"1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"},
		[6]int64{16384, 33024, 33024, 66304, 66304, 133120}),
}

// MIGCapable reports whether model (a GPUModels identifier) supports MIG.
func MIGCapable(model string) bool { return len(migProfiles[model]) > 0 }

// MIGModels are the MIG-capable models, in GPUModels order.
func MIGModels() []string {
	var out []string
	for _, m := range GPUModels {
		if MIGCapable(m) {
			out = append(out, m)
		}
	}
	return out
}

// MIGProfiles returns model's profiles (a copy), nil when it has no MIG.
func MIGProfiles(model string) []MIGProfile {
	ps := migProfiles[model]
	if ps == nil {
		return nil
	}
	out := make([]MIGProfile, len(ps))
	for i, p := range ps {
		p.Starts = slices.Clone(p.Starts)
		out[i] = p
	}
	return out
}

// LookupMIGProfile returns the profile of model named name, with an error
// that names the valid ones.
func LookupMIGProfile(model, name string) (MIGProfile, error) {
	p, ok := migProfile(model, name)
	if ok {
		p.Starts = slices.Clone(p.Starts)
		return p, nil
	}
	if !MIGCapable(model) {
		return MIGProfile{}, fmt.Errorf("GPU model %q has no MIG; MIG-capable models are %v", model, MIGModels())
	}
	return MIGProfile{}, fmt.Errorf("unknown MIG profile %q for %s; want one of %s", name, model, strings.Join(migNames(model), ", "))
}

// migProfile is the table's own entry (not copied: read only).
func migProfile(model, name string) (MIGProfile, bool) {
	ps := migProfiles[model]
	i := slices.IndexFunc(ps, func(p MIGProfile) bool { return p.Name == name })
	if i < 0 {
		return MIGProfile{}, false
	}
	return ps[i], true
}

func migNames(model string) []string {
	var names []string
	for _, p := range migProfiles[model] {
		names = append(names, p.Name)
	}
	return names
}

// ValidateMIGPlacements checks that ps can exist together on one GPU of
// model: every profile is the model's, every start is allowed for its
// profile, no two placements share a memory slice, and the compute slices
// add up to at most 7. It reports every problem at once; an empty set is
// valid (MIG mode on, no instances).
func ValidateMIGPlacements(model string, ps []MIGPlacement) error {
	if !MIGCapable(model) {
		return fmt.Errorf("GPU model %q has no MIG; MIG-capable models are %v", model, MIGModels())
	}
	var errs []error
	var owner [MIGMemorySlices]int // 1 + index of the placement holding each slice
	compute := 0
	for i, pl := range ps {
		p, ok := migProfile(model, pl.Profile)
		if !ok {
			errs = append(errs, fmt.Errorf("placement %d (%s): unknown MIG profile %q for %s; want one of %s",
				i, pl, pl.Profile, model, strings.Join(migNames(model), ", ")))
			continue
		}
		if !slices.Contains(p.Starts, pl.Start) {
			errs = append(errs, fmt.Errorf("placement %d (%s): %s may start at memory slice %v, not %d",
				i, pl, p.Name, p.Starts, pl.Start))
			continue
		}
		compute += p.ComputeSlices
		for s := pl.Start; s < pl.Start+p.MemorySlices; s++ {
			if o := owner[s]; o != 0 {
				errs = append(errs, fmt.Errorf("placement %d (%s) overlaps placement %d (%s) on memory slice %d",
					i, pl, o-1, ps[o-1], s))
				break
			}
			owner[s] = i + 1
		}
	}
	if compute > MIGComputeSlices {
		errs = append(errs, fmt.Errorf("placements use %d compute slices; a GPU has %d", compute, MIGComputeSlices))
	}
	return errors.Join(errs...)
}

// FreeMIGPlacements lists, in start order, every placement of profile
// that could be added to existing (a valid set) on one GPU of model.
func FreeMIGPlacements(model, profile string, existing []MIGPlacement) ([]MIGPlacement, error) {
	p, err := LookupMIGProfile(model, profile)
	if err != nil {
		return nil, err
	}
	if err := ValidateMIGPlacements(model, existing); err != nil {
		return nil, fmt.Errorf("existing placements: %w", err)
	}
	var used [MIGMemorySlices]bool
	compute := 0
	for _, pl := range existing {
		q, _ := migProfile(model, pl.Profile)
		compute += q.ComputeSlices
		for s := pl.Start; s < pl.Start+q.MemorySlices; s++ {
			used[s] = true
		}
	}
	if compute+p.ComputeSlices > MIGComputeSlices {
		return nil, nil
	}
	var out []MIGPlacement
	for _, start := range p.Starts {
		if !slices.Contains(used[start:start+p.MemorySlices], true) {
			out = append(out, MIGPlacement{Profile: p.Name, Start: start})
		}
	}
	return out, nil
}

// PlaceMIG finds placements for a layout, a list of profile names, on an
// empty GPU of model, the way nvidia-smi mig -cgi picks them when given no
// placement: it tries the larger instances first, each at the lowest free
// start, backtracking when a later one does not fit. The result is in the
// layout's order.
func PlaceMIG(model string, layout []string) ([]MIGPlacement, error) {
	if !MIGCapable(model) {
		return nil, fmt.Errorf("GPU model %q has no MIG; MIG-capable models are %v", model, MIGModels())
	}
	profiles := make([]MIGProfile, len(layout))
	var errs []error
	for i, name := range layout {
		p, ok := migProfile(model, name)
		if !ok {
			errs = append(errs, fmt.Errorf("layout entry %d: unknown MIG profile %q for %s; want one of %s",
				i, name, model, strings.Join(migNames(model), ", ")))
		}
		profiles[i] = p
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	compute, memory := 0, 0
	for _, p := range profiles {
		compute, memory = compute+p.ComputeSlices, memory+p.MemorySlices
	}
	if compute > MIGComputeSlices || memory > MIGMemorySlices {
		return nil, fmt.Errorf("MIG layout %v needs %d compute and %d memory slices; a %s has %d and %d",
			layout, compute, memory, model, MIGComputeSlices, MIGMemorySlices)
	}
	order := make([]int, len(layout))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return profiles[b].MemorySlices*8 + profiles[b].ComputeSlices - profiles[a].MemorySlices*8 - profiles[a].ComputeSlices
	})
	out := make([]MIGPlacement, len(layout))
	var used [MIGMemorySlices]bool
	var place func(k, compute int) bool
	place = func(k, compute int) bool {
		if k == len(order) {
			return true
		}
		i := order[k]
		p := profiles[i]
		if compute+p.ComputeSlices > MIGComputeSlices {
			return false
		}
		for _, start := range p.Starts {
			span := used[start : start+p.MemorySlices]
			if slices.Contains(span, true) {
				continue
			}
			for s := range span {
				span[s] = true
			}
			out[i] = MIGPlacement{Profile: p.Name, Start: start}
			if place(k+1, compute+p.ComputeSlices) {
				return true
			}
			for s := range span {
				span[s] = false
			}
		}
		return false
	}
	if !place(0, 0) {
		return nil, fmt.Errorf("MIG layout %v does not fit one %s (7 compute and 8 memory slices, placements as nvidia-smi mig -lgipp lists)", layout, model)
	}
	return out, nil
}
