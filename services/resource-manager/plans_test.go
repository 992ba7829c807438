package resourcemanager

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestCommitGroups(t *testing.T) {
	item := func(id, node string) contracts.Allocation { return contracts.Allocation{ID: id, NodeID: node} }
	tests := map[string]struct {
		items []contracts.Allocation
		want  [][]int
	}{
		"empty":                 {nil, [][]int{}},
		"one node keeps order":  {[]contracts.Allocation{item("a", "n1"), item("b", "n1"), item("c", "n1")}, [][]int{{0, 1, 2}}},
		"nodes apart, in order": {[]contracts.Allocation{item("a", "n1"), item("b", "n2"), item("c", "n1")}, [][]int{{0, 2}, {1}}},
		"repeated allocation is one serial group": {
			[]contracts.Allocation{item("a", "n1"), item("b", "n2"), item("a", "n2")}, [][]int{{0, 1, 2}}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, commitGroups(tt.items)); diff != "" {
				t.Errorf("commitGroups (-want +got):\n%s", diff)
			}
		})
	}
}
