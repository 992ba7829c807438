package gpuplane

import (
	"reflect"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// An autoscaled machine takes the settings of its pool's fleet template:
// the fleet pool of its name (count 0: a template only), else one of its
// machine type and price class, else none.
func TestAutoscaledMachinesTakeTheirFleetTemplate(t *testing.T) {
	fl := fleet.Default()
	fl.Pools = append(fl.Pools, fleet.Pool{Name: "burst", MachineType: "hgx-h100-8", Count: 0, Zone: "zone-c",
		PriceClass: "spot", Taints: []string{"burst=true:NoSchedule"}})
	spotTaint := []contracts.Taint{{Key: "gpuplane.io/spot", Value: "true", Effect: "PreferNoSchedule"}}
	tests := map[string]struct {
		pool AutoscalePool
		want fleet.Machine
	}{
		"default l4-spot takes l4's zone and spot taint": {
			pool: DefaultAutoscale()[0],
			want: fleet.Machine{Pool: "l4-spot", Zone: "zone-b", PriceClass: cloud.Spot, Purpose: "inference",
				Labels: map[string]string{"tier": "inference"}, Taints: spotTaint},
		},
		"a count-0 pool of its name is its template": {
			pool: AutoscalePool{Name: "burst", MachineType: "hgx-h100-8", PriceClass: cloud.Spot},
			want: fleet.Machine{Pool: "burst", Zone: "zone-c", PriceClass: cloud.Spot,
				Taints: []contracts.Taint{{Key: "burst", Value: "true", Effect: "NoSchedule"}}},
		},
		"no pool of its type and price class: the shape only": {
			pool: AutoscalePool{Name: "a100-spot", MachineType: "hgx-a100-8", PriceClass: cloud.Spot},
			want: fleet.Machine{Pool: "a100-spot", PriceClass: cloud.Spot},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			s := &simMachines{fleet: fl, like: settingsOf(fl, []AutoscalePool{tc.pool})}
			got, err := s.machine(cloud.Machine{ID: "m1", NodeID: "n1", Pool: tc.pool.Name, MachineType: tc.pool.MachineType, PriceClass: tc.pool.PriceClass})
			if err != nil {
				t.Fatal(err)
			}
			type settings struct {
				Pool, Zone, PriceClass, Purpose string
				Labels                          map[string]string
				Taints                          []contracts.Taint
			}
			pick := func(m fleet.Machine) settings {
				return settings{m.Pool, m.Zone, m.PriceClass, m.Purpose, m.Labels, m.Taints}
			}
			if w, g := pick(tc.want), pick(got); !reflect.DeepEqual(w, g) {
				t.Errorf("machine settings %+v; want %+v", g, w)
			}
			if got.GPUCount == 0 || got.MachineType != tc.pool.MachineType {
				t.Errorf("machine %+v: want the %s shape", got, tc.pool.MachineType)
			}
		})
	}
}
