package contracts

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func at(profile string, starts ...int) []MIGPlacement {
	var out []MIGPlacement
	for _, s := range starts {
		out = append(out, MIGPlacement{Profile: profile, Start: s})
	}
	return out
}

func join(sets ...[]MIGPlacement) []MIGPlacement { return slices.Concat(sets...) }

func TestMIGProfilesMatchNVIDIA(t *testing.T) {
	// Names and instance counts from the MIG user guide's "Supported MIG
	// Profiles"; placements as nvidia-smi mig -lgipp prints them:
	// {0,1,2,3,4,5,6}:1, {0,2,4,6}:2, {0,2,4}:2, {0,4}:4, {0}:4, {0}:8.
	type row struct {
		name           string
		g, size, max   int
		starts         string
		memGiBx100     int64 // nvidia-smi -lgip's GiB column, times 100, rounded
		profileID      int
		computeInName  int
		memorySlicePos int
	}
	shape := func(names ...string) []string { return names }
	for model, names := range map[string][]string{
		"A100-40GB":      shape("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
		"A100-80GB":      shape("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
		"H100-80GB":      shape("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
		"H100-80GB-PCIE": shape("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
		"H200-141GB":     shape("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
	} {
		want := []struct {
			g, size, max, id int
			starts           []int
		}{
			{1, 1, 7, 19, []int{0, 1, 2, 3, 4, 5, 6}},
			{1, 2, 4, 15, []int{0, 2, 4, 6}},
			{2, 2, 3, 14, []int{0, 2, 4}},
			{3, 4, 2, 9, []int{0, 4}},
			{4, 4, 1, 5, []int{0}},
			{7, 8, 1, 0, []int{0}},
		}
		got := MIGProfiles(model)
		if len(got) != len(want) {
			t.Fatalf("%s: %d profiles, want %d", model, len(got), len(want))
		}
		for i, p := range got {
			w := want[i]
			if p.Name != names[i] || p.ComputeSlices != w.g || p.MemorySlices != w.size || p.MaxInstances != w.max ||
				p.ProfileID != w.id || !slices.Equal(p.Starts, w.starts) {
				t.Errorf("%s profile %d = %+v; want %s g=%d size=%d max=%d id=%d starts=%v",
					model, i, p, names[i], w.g, w.size, w.max, w.id, w.starts)
			}
			g, _, _ := strings.Cut(p.Name, "g.")
			if n, err := strconv.Atoi(g); err != nil || n != p.ComputeSlices {
				t.Errorf("%s %s: name says %sg, compute slices %d", model, p.Name, g, p.ComputeSlices)
			}
			if i > 0 && p.MemoryMiB < got[i-1].MemoryMiB {
				t.Errorf("%s %s: %d MiB, less than %s's %d", model, p.Name, p.MemoryMiB, got[i-1].Name, got[i-1].MemoryMiB)
			}
		}
		// A profile's MaxInstances copies of itself fit; one more does not.
		for _, p := range got {
			layout := slices.Repeat([]string{p.Name}, p.MaxInstances)
			if _, err := PlaceMIG(model, layout); err != nil {
				t.Errorf("%s: %d × %s: %v", model, p.MaxInstances, p.Name, err)
			}
			if _, err := PlaceMIG(model, append(layout, p.Name)); err == nil {
				t.Errorf("%s: %d × %s placed; want at most %d", model, p.MaxInstances+1, p.Name, p.MaxInstances)
			}
		}
	}
	// Figures nvidia-smi mig -lgip prints (GiB): A100 40GB as in the
	// go-nvml dgxa100 mock, H100 80GB as on an HGX H100.
	for _, c := range []struct {
		model, profile string
		mib            int64
	}{
		{"A100-40GB", "1g.5gb", 4864}, {"A100-40GB", "3g.20gb", 19968}, {"A100-40GB", "7g.40gb", 40192},
		{"H100-80GB", "1g.10gb", 9984}, {"H100-80GB", "3g.40gb", 40448}, {"H100-80GB", "7g.80gb", 81152},
		{"H200-141GB", "1g.18gb", 16384},
	} {
		p, err := LookupMIGProfile(c.model, c.profile)
		if err != nil || p.MemoryMiB != c.mib {
			t.Errorf("%s %s: %d MiB, %v; want %d", c.model, c.profile, p.MemoryMiB, err, c.mib)
		}
	}
	for _, m := range []string{"V100-16GB", "V100-32GB", "L4", "T4", "L40S", "nope"} {
		if MIGCapable(m) || MIGProfiles(m) != nil {
			t.Errorf("%s: MIG-capable; it is not", m)
		}
	}
	if want := []string{"A100-40GB", "A100-80GB", "H100-80GB", "H100-80GB-PCIE", "H200-141GB"}; !slices.Equal(MIGModels(), want) {
		t.Errorf("MIGModels() = %v, want %v", MIGModels(), want)
	}
}

func TestMIGProfilesAreCopies(t *testing.T) {
	ps := MIGProfiles("A100-80GB")
	ps[0].Starts[0] = 5
	ps[0].Name = "x"
	if again := MIGProfiles("A100-80GB"); again[0].Starts[0] != 0 || again[0].Name != "1g.10gb" {
		t.Fatalf("changing a returned profile changed the table: %+v", again[0])
	}
}

func TestValidateMIGPlacementsAcceptsValidSets(t *testing.T) {
	for name, c := range map[string]struct {
		model string
		ps    []MIGPlacement
	}{
		"empty (MIG on, no instances)": {"A100-80GB", nil},
		"3g + 3g":                      {"A100-80GB", join(at("3g.40gb", 0, 4))},
		"4g + 3g":                      {"A100-80GB", join(at("4g.40gb", 0), at("3g.40gb", 4))},
		"7 × 1g":                       {"A100-80GB", at("1g.10gb", 0, 1, 2, 3, 4, 5, 6)},
		"4 × 1g.20gb":                  {"H100-80GB", at("1g.20gb", 0, 2, 4, 6)},
		"3 × 2g + 1g":                  {"H100-80GB", join(at("2g.20gb", 0, 2, 4), at("1g.10gb", 6))},
		"7g alone":                     {"H200-141GB", at("7g.141gb", 0)},
		// The MIG user guide's mixed example: -cgi 19,14,5 gives 1g.5gb
		// at 6:1, 2g.10gb at 4:2 and 4g.20gb at 0:4.
		"guide's 4g + 2g + 1g": {"A100-40GB", join(at("1g.5gb", 6), at("2g.10gb", 4), at("4g.20gb", 0))},
		"3g + 2g + 1g.35gb":    {"H200-141GB", join(at("3g.71gb", 0), at("2g.35gb", 4), at("1g.35gb", 6))},
		"1g.20gb and 1g.10gb":  {"H100-80GB-PCIE", join(at("1g.20gb", 0), at("1g.10gb", 2, 3))},
	} {
		if err := ValidateMIGPlacements(c.model, c.ps); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestValidateMIGPlacementsRejectsInvalidSets(t *testing.T) {
	for name, c := range map[string]struct {
		model string
		ps    []MIGPlacement
		want  []string // every one appears in the error
	}{
		"3g at a 2g start":       {"A100-80GB", at("3g.40gb", 2), []string{"3g.40gb may start at memory slice [0 4], not 2"}},
		"2g at slice 6":          {"A100-80GB", at("2g.20gb", 6), []string{"not 6"}},
		"negative start":         {"A100-80GB", at("1g.10gb", -1), []string{"not -1"}},
		"start past the GPU":     {"A100-80GB", at("1g.10gb", 8), []string{"not 8"}},
		"4g over 3g":             {"A100-80GB", join(at("4g.40gb", 0), at("3g.40gb", 0)), []string{"overlaps placement 0 (4g.40gb@0) on memory slice 0"}},
		"7g and anything":        {"H100-80GB", join(at("7g.80gb", 0), at("1g.10gb", 6)), []string{"overlaps"}},
		"3g then 1g inside it":   {"H100-80GB", join(at("3g.40gb", 0), at("1g.10gb", 3)), []string{"on memory slice 3"}},
		"five 1g.20gb":           {"A100-80GB", at("1g.20gb", 0, 2, 4, 6, 6), []string{"overlaps"}},
		"the same slot twice":    {"A100-40GB", at("1g.5gb", 2, 2), []string{"placement 1 (1g.5gb@2) overlaps placement 0"}},
		"8 × 1g: overlap, and 8": {"A100-80GB", at("1g.10gb", 0, 1, 2, 3, 4, 5, 6, 0), []string{"overlaps", "8 compute slices"}},
		"another model's name":   {"A100-80GB", at("1g.5gb", 0), []string{`unknown MIG profile "1g.5gb" for A100-80GB`, "1g.10gb, 1g.20gb"}},
		"a card without MIG":     {"L4", at("1g.10gb", 0), []string{`"L4" has no MIG`}},
		"every problem at once":  {"H200-141GB", join(at("3g.71gb", 2), at("9g.1gb", 0)), []string{"not 2", `"9g.1gb"`}},
	} {
		err := ValidateMIGPlacements(c.model, c.ps)
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q does not say %q", name, err, w)
			}
		}
	}
}

func TestFreeMIGPlacements(t *testing.T) {
	for name, c := range map[string]struct {
		model, profile string
		existing       []MIGPlacement
		want           []MIGPlacement
	}{
		"empty GPU, 1g":          {"A100-80GB", "1g.10gb", nil, at("1g.10gb", 0, 1, 2, 3, 4, 5, 6)},
		"second 3g":              {"A100-80GB", "3g.40gb", at("3g.40gb", 0), at("3g.40gb", 4)},
		"3g beside a 4g":         {"A100-80GB", "3g.40gb", at("4g.40gb", 0), at("3g.40gb", 4)},
		"4g beside a 3g at 4":    {"H100-80GB", "4g.40gb", at("3g.40gb", 4), at("4g.40gb", 0)},
		"4g beside a 3g at 0":    {"H100-80GB", "4g.40gb", at("3g.40gb", 0), nil},
		"1g beside a 4g":         {"A100-80GB", "1g.10gb", at("4g.40gb", 0), at("1g.10gb", 4, 5, 6)},
		"1g.20gb beside a 4g":    {"A100-80GB", "1g.20gb", at("4g.40gb", 0), at("1g.20gb", 4, 6)},
		"2g beside a 4g":         {"H200-141GB", "2g.35gb", at("4g.71gb", 0), at("2g.35gb", 4)},
		"7g on a used GPU":       {"A100-80GB", "7g.80gb", at("1g.10gb", 3), nil},
		"full with 7 × 1g":       {"A100-80GB", "1g.10gb", at("1g.10gb", 0, 1, 2, 3, 4, 5, 6), nil},
		"compute full, slice 7":  {"A100-80GB", "1g.20gb", join(at("4g.40gb", 0), at("3g.40gb", 4)), nil},
		"around a 2g in the mid": {"A100-40GB", "3g.20gb", at("2g.10gb", 2), at("3g.20gb", 4)},
	} {
		got, err := FreeMIGPlacements(c.model, c.profile, c.existing)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if d := cmp.Diff(c.want, got); d != "" {
			t.Errorf("%s: free placements (-want +got):\n%s", name, d)
		}
	}
	if _, err := FreeMIGPlacements("A100-80GB", "1g.10gb", at("3g.40gb", 2)); err == nil {
		t.Error("invalid existing placements accepted")
	}
	if _, err := FreeMIGPlacements("A100-80GB", "1g.18gb", nil); err == nil || !strings.Contains(err.Error(), "unknown MIG profile") {
		t.Errorf("unknown profile: %v", err)
	}
}

func TestPlaceMIG(t *testing.T) {
	for name, c := range map[string]struct {
		model  string
		layout []string
		want   []MIGPlacement
	}{
		"3g + 3g":           {"A100-80GB", []string{"3g.40gb", "3g.40gb"}, at("3g.40gb", 0, 4)},
		"small first":       {"A100-80GB", []string{"1g.10gb", "4g.40gb"}, join(at("1g.10gb", 4), at("4g.40gb", 0))},
		"3g then 4g":        {"H100-80GB", []string{"3g.40gb", "4g.40gb"}, join(at("3g.40gb", 4), at("4g.40gb", 0))},
		"7 × 1g":            {"H200-141GB", slices.Repeat([]string{"1g.18gb"}, 7), at("1g.18gb", 0, 1, 2, 3, 4, 5, 6)},
		"2g × 3 + 1g":       {"A100-40GB", []string{"1g.5gb", "2g.10gb", "2g.10gb", "2g.10gb"}, join(at("1g.5gb", 6), at("2g.10gb", 0, 2, 4))},
		"3g + 2g + 1g.20gb": {"A100-80GB", []string{"1g.20gb", "3g.40gb", "2g.20gb"}, join(at("1g.20gb", 6), at("3g.40gb", 0), at("2g.20gb", 4))},
		"empty layout":      {"A100-80GB", nil, []MIGPlacement{}},
		"one of each 1g":    {"H100-80GB", []string{"1g.20gb", "1g.10gb", "1g.10gb"}, join(at("1g.20gb", 0), at("1g.10gb", 2, 3))},
		"2g + 3 × 1g.20gb":  {"A100-80GB", []string{"2g.20gb", "1g.20gb", "1g.20gb", "1g.20gb"}, join(at("2g.20gb", 0), at("1g.20gb", 2, 4, 6))},
		// 3g@0 leaves one 2g start free: the 3g moves to 4.
		"backtracks the 3g": {"A100-80GB", []string{"3g.40gb", "2g.20gb", "2g.20gb"}, join(at("3g.40gb", 4), at("2g.20gb", 0, 2))},
		// 1g.20gb@4 strands slice 7: it moves to 6.
		"backtracks the 1g.20gb": {"H100-80GB", []string{"4g.40gb", "1g.20gb", "1g.10gb", "1g.10gb"}, join(at("4g.40gb", 0), at("1g.20gb", 6), at("1g.10gb", 4, 5))},
	} {
		got, err := PlaceMIG(c.model, c.layout)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if d := cmp.Diff(c.want, got); d != "" {
			t.Errorf("%s: placements (-want +got):\n%s", name, d)
		}
		if err := ValidateMIGPlacements(c.model, got); err != nil {
			t.Errorf("%s: PlaceMIG returned an invalid set: %v", name, err)
		}
	}
	for name, c := range map[string]struct {
		model  string
		layout []string
		want   string
	}{
		"7g + 1g":         {"A100-80GB", []string{"7g.80gb", "1g.10gb"}, "needs 8 compute"},
		"4g + 4g":         {"A100-80GB", []string{"4g.40gb", "4g.40gb"}, "needs 8 compute"},
		"3 × 3g":          {"H100-80GB", []string{"3g.40gb", "3g.40gb", "3g.40gb"}, "needs 9 compute"},
		"too much memory": {"A100-80GB", []string{"4g.40gb", "1g.20gb", "1g.20gb", "1g.10gb"}, "and 9 memory slices"},
		"no MIG":          {"T4", []string{"1g.10gb"}, "has no MIG"},
		"bad name":        {"A100-40GB", []string{"3g.40gb"}, `layout entry 0: unknown MIG profile "3g.40gb" for A100-40GB`},
	} {
		if _, err := PlaceMIG(c.model, c.layout); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want an error saying %q", name, err, c.want)
		}
	}
}

// FuzzMIGPlacements checks ValidateMIGPlacements against the rules
// computed independently, and that FreeMIGPlacements only offers
// placements that keep the set valid.
func FuzzMIGPlacements(f *testing.F) {
	f.Add([]byte{1, 3, 0, 3, 4})
	f.Add([]byte{0, 0, 0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6})
	f.Add([]byte{4, 4, 0, 3, 4, 0, 0})
	f.Add([]byte{2, 1, 0, 1, 2, 1, 4, 1, 6, 1, 7})
	models := MIGModels()
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 || len(data) > 41 {
			return
		}
		model := models[int(data[0])%len(models)]
		profiles := MIGProfiles(model)
		var ps []MIGPlacement
		for i := 1; i+1 < len(data); i += 2 {
			p := profiles[int(data[i])%len(profiles)]
			ps = append(ps, MIGPlacement{Profile: p.Name, Start: int(data[i+1]%10) - 1}) // -1..8: some outside the GPU
		}
		err := ValidateMIGPlacements(model, ps)
		if want := independentCheck(profiles, ps); (err == nil) != (want == "") {
			t.Fatalf("%s %v: ValidateMIGPlacements = %v, independent check says %q", model, ps, err, want)
		}
		if err != nil {
			return
		}
		for _, p := range profiles {
			free, err := FreeMIGPlacements(model, p.Name, ps)
			if err != nil {
				t.Fatalf("%s %v: free %s: %v", model, ps, p.Name, err)
			}
			for _, pl := range free {
				if msg := independentCheck(profiles, append(slices.Clone(ps), pl)); msg != "" {
					t.Fatalf("%s %v: free placement %s makes the set invalid: %s", model, ps, pl, msg)
				}
			}
			// And every valid addition is offered.
			for _, start := range p.Starts {
				pl := MIGPlacement{Profile: p.Name, Start: start}
				if independentCheck(profiles, append(slices.Clone(ps), pl)) == "" && !slices.Contains(free, pl) {
					t.Fatalf("%s %v: %s fits but is not offered (%v)", model, ps, pl, free)
				}
			}
		}
	})
}

// independentCheck is the placement rule written another way: a bitmask
// of memory slices per placement; "" when valid.
func independentCheck(profiles []MIGProfile, ps []MIGPlacement) string {
	var mask uint16
	compute := 0
	for _, pl := range ps {
		i := slices.IndexFunc(profiles, func(p MIGProfile) bool { return p.Name == pl.Profile })
		p := profiles[i]
		if !slices.Contains(p.Starts, pl.Start) {
			return fmt.Sprintf("%s: start not allowed", pl)
		}
		m := uint16(1<<p.MemorySlices-1) << pl.Start
		if m&^0xff != 0 {
			return fmt.Sprintf("%s: beyond slice 7", pl)
		}
		if mask&m != 0 {
			return fmt.Sprintf("%s: overlaps", pl)
		}
		mask |= m
		compute += p.ComputeSlices
	}
	if compute > 7 {
		return "more than 7 compute slices"
	}
	return ""
}
