package wire

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// The fast path knows the wire keys by hand and skips unknown ones, so a
// field added to a telemetry struct would decode to zero without an error.
// This keeps the hand-written lists equal to the structs' json tags.
func TestKnownKeysAreTheStructsFields(t *testing.T) {
	tests := []struct {
		name  string
		typ   reflect.Type
		known []string
	}{
		{"Telemetry", reflect.TypeFor[contracts.Telemetry](), telemetryKeys},
		{"GPUSample", reflect.TypeFor[contracts.GPUSample](), sampleKeys},
		{"GPUProcess", reflect.TypeFor[contracts.GPUProcess](), processKeys},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var tags []string
			for f := range tc.typ.Fields() {
				name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
				if name != "" && name != "-" {
					tags = append(tags, name)
				}
			}
			got, want := slices.Sorted(slices.Values(tc.known)), slices.Sorted(slices.Values(tags))
			if !slices.Equal(got, want) {
				t.Fatalf("fast-path keys %v, struct fields %v: update the lists and the decoder", got, want)
			}
		})
	}
}
