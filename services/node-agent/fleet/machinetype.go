package fleet

import (
	"fmt"
	"reflect"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// MIGSpec is a machine type's MIG setting: every GPU in MIG mode with
// the instances of Layout, placed by NVIDIA's rules, e.g.
//
//	mig: {enabled: true, layout: ["3g.40gb", "3g.40gb"]}
type MIGSpec struct {
	Enabled bool     `yaml:"enabled"`
	Layout  []string `yaml:"layout,omitempty"`
}

// sim is the simulator's MIG setting; a nil spec is MIG off.
func (s *MIGSpec) sim() sim.MIG {
	if s == nil {
		return sim.MIG{}
	}
	return sim.MIG{Enabled: s.Enabled, Layout: s.Layout}
}

// UnmarshalYAML reads nvlink as true (an SXM board), false, or pairs (PCIe
// cards joined by NVLink bridges). Decoding through a yaml.Node drops the
// decoder's KnownFields check, so unknown keys are refused here.
func (t *MachineType) UnmarshalYAML(n *yaml.Node) error {
	if err := knownKeys(n, "machine type", reflect.TypeFor[MachineType]()); err != nil {
		return err
	}
	bridges := false
	if n.Kind == yaml.MappingNode {
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			if k.Value != "nvlink" || v.Kind != yaml.ScalarNode || v.Tag == "!!bool" {
				continue
			}
			if v.Value != "pairs" {
				return fmt.Errorf("line %d: nvlink is %q; want true (an SXM board), false or pairs (PCIe cards joined by NVLink bridges)", v.Line, v.Value)
			}
			c := *n
			c.Content = slices.Clone(n.Content)
			c.Content[i+1] = &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!bool", Value: "false", Line: v.Line, Column: v.Column}
			n, bridges = &c, true
		}
	}
	type plain MachineType // without this method
	var p plain
	if err := n.Decode(&p); err != nil {
		return err
	}
	*t = MachineType(p)
	t.NVLinkBridges = bridges
	return nil
}

// UnmarshalYAML refuses unknown keys (see MachineType.UnmarshalYAML).
func (s *MIGSpec) UnmarshalYAML(n *yaml.Node) error {
	if err := knownKeys(n, "mig", reflect.TypeFor[MIGSpec]()); err != nil {
		return err
	}
	type plain MIGSpec
	return n.Decode((*plain)(s))
}

// knownKeys checks that a mapping node has only the yaml keys of struct
// type t.
func knownKeys(n *yaml.Node, what string, t reflect.Type) error {
	if n.Kind != yaml.MappingNode {
		return nil // n.Decode reports the type mismatch
	}
	var known []string
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name != "" && name != "-" {
			known = append(known, name)
		}
	}
	for i := 0; i < len(n.Content); i += 2 {
		if k := n.Content[i]; !slices.Contains(known, k.Value) {
			return fmt.Errorf("line %d: unknown field %q in %s; want one of %s", k.Line, k.Value, what, strings.Join(known, ", "))
		}
	}
	return nil
}
