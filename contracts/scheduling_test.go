package contracts

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// schedRequest is a valid request of one whole GPU, changed by mod.
func schedRequest(mod func(r *JobRequest)) JobRequest {
	r := JobRequest{ID: "train-1", Resources: Resources{GPU: GPURequest{Count: 1}},
		Run: RunSpec{Duration: Duration(time.Minute)}}
	if mod != nil {
		mod(&r)
	}
	return r
}

func manyStrings(n int, f func(i int) string) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = f(i)
	}
	return out
}

func TestValidateSchedulingAccepts(t *testing.T) {
	tests := map[string]func(r *JobRequest){
		"mig on one model": func(r *JobRequest) {
			r.Resources.GPU = GPURequest{Count: 1, Model: "H100-80GB", MIGProfile: "1g.10gb"}
		},
		"mig on any mig model": func(r *JobRequest) { r.Resources.GPU = GPURequest{Count: 1, MIGProfile: "3g.40gb"} },
		"mig among models": func(r *JobRequest) {
			// 1g.5gb is only the A100 40GB's: one allowed model is enough.
			r.Resources.GPU = GPURequest{Count: 1, Models: []string{"H100-80GB", "A100-40GB"}, MIGProfile: "1g.5gb"}
		},
		"share": func(r *JobRequest) {
			r.Resources.GPU = GPURequest{Count: 1, Model: "L4", Share: &GPUShare{MemoryMiB: 4096, ComputePercent: 25}}
		},
		"share at its bounds": func(r *JobRequest) {
			r.Resources.GPU = GPURequest{Count: 1, Share: &GPUShare{MemoryMiB: MaxGPUMemoryMiB, ComputePercent: 99}}
		},
		"gang over nvlink": func(r *JobRequest) {
			r.Resources.GPU = GPURequest{Count: 16, Model: "H100-80GB", Nodes: 2, Topology: TopologyNVLink}
			r.Resources.CPUMilli, r.Resources.MemoryMiB = 96000, 512*1024
		},
		"gang in one zone": func(r *JobRequest) { r.Resources.GPU = GPURequest{Count: 4, Nodes: 4, Topology: TopologyZone} },
		"largest gang":     func(r *JobRequest) { r.Resources.GPU = GPURequest{Count: MaxNodesPerJob, Nodes: MaxNodesPerJob} },
		"nodes 1":          func(r *JobRequest) { r.Resources.GPU = GPURequest{Count: 3, Nodes: 1} },
		"models with any": func(r *JobRequest) {
			r.Resources.GPU = GPURequest{Count: 1, Model: GPUModelAny, Models: []string{"L4", "T4"}}
		},
		"selector and tolerations": func(r *JobRequest) {
			r.NodeSelector = map[string]string{"zone": "a", "purpose": "training"}
			r.Tolerations = []Toleration{
				{Key: "spot", Operator: TolerationEqual, Value: "true", Effect: TaintNoSchedule},
				{Key: "dedicated", Value: "research"},
				{Key: "gpu-test", Operator: TolerationExists, Effect: TaintPreferNoSchedule},
				{Operator: TolerationExists},
			}
		},
		"dependencies and times": func(r *JobRequest) {
			r.DependsOn = []string{"prep", "data-1"}
			r.PlacementTimeout = Duration(MaxPlacementWait)
			r.ExpectedRunTime = Duration(MaxExpectedRunTime)
		},
		"limits": func(r *JobRequest) {
			r.DependsOn = manyStrings(MaxDependsOn, func(i int) string { return "d" + strconv.Itoa(i) })
			r.Tolerations = make([]Toleration, MaxTolerations)
			for i := range r.Tolerations {
				r.Tolerations[i] = Toleration{Key: "k" + strconv.Itoa(i), Operator: TolerationExists}
			}
			r.NodeSelector = map[string]string{}
			for i := range MaxSelectorLabels {
				r.NodeSelector["k"+strconv.Itoa(i)] = "v"
			}
			r.Resources.GPU.Models = GPUModels[:min(len(GPUModels), MaxAllowedModels)]
		},
	}
	for name, mod := range tests {
		t.Run(name, func(t *testing.T) {
			r := schedRequest(mod)
			if err := r.Validate("acme"); err != nil {
				t.Fatalf("Validate: %v", err)
			}
		})
	}
}

// TestValidateSchedulingRejects is the catalogue of bad scheduling fields:
// each gets its field, its reason and a message that says what is wrong.
func TestValidateSchedulingRejects(t *testing.T) {
	tests := map[string]struct {
		mod     func(r *JobRequest)
		field   string
		reason  Reason
		message string
	}{
		"too many models": {func(r *JobRequest) {
			r.Resources.GPU.Models = manyStrings(MaxAllowedModels+1, func(int) string { return "L4" })
		}, "resources.gpu.models", ReasonOutOfRange, "17 models, limit is 16"},
		"unknown model in models": {func(r *JobRequest) { r.Resources.GPU.Models = []string{"L4", "Z100"} },
			"resources.gpu.models", ReasonUnknownGPUModel, `unknown GPU model "Z100"`},
		"model and models": {func(r *JobRequest) { r.Resources.GPU.Model, r.Resources.GPU.Models = "L4", []string{"T4"} },
			"resources.gpu.models", ReasonConflictingRun, "set model or models, not both"},
		"mig and share": {func(r *JobRequest) {
			r.Resources.GPU.MIGProfile, r.Resources.GPU.Share = "1g.10gb", &GPUShare{MemoryMiB: 1024, ComputePercent: 10}
		}, "resources.gpu.share", ReasonInvalidValue, "a MIG instance or a share, not both"},
		"mig of two": {func(r *JobRequest) { r.Resources.GPU.Count, r.Resources.GPU.MIGProfile = 2, "1g.10gb" },
			"resources.gpu.count", ReasonOutOfRange, "a MIG request takes one instance; count is 2"},
		"unknown mig profile": {func(r *JobRequest) { r.Resources.GPU.MIGProfile = "9g.1tb" },
			"resources.gpu.migProfile", ReasonInvalidValue, `no allowed model has MIG profile "9g.1tb"`},
		"mig on a model without mig": {func(r *JobRequest) { r.Resources.GPU.Model, r.Resources.GPU.MIGProfile = "L4", "1g.10gb" },
			"resources.gpu.migProfile", ReasonInvalidValue, `no allowed model has MIG profile "1g.10gb"`},
		"mig profile of another model": {func(r *JobRequest) { r.Resources.GPU.Model, r.Resources.GPU.MIGProfile = "H100-80GB", "1g.5gb" },
			"resources.gpu.migProfile", ReasonInvalidValue, "MIG-capable models are"},
		"share of two": {func(r *JobRequest) {
			r.Resources.GPU.Count, r.Resources.GPU.Share = 2, &GPUShare{MemoryMiB: 1024, ComputePercent: 10}
		}, "resources.gpu.count", ReasonOutOfRange, "a share is of one GPU; count is 2"},
		"share of no compute": {func(r *JobRequest) { r.Resources.GPU.Share = &GPUShare{MemoryMiB: 1024} },
			"resources.gpu.share.computePercent", ReasonOutOfRange, "compute share 0%; want 1 to 99"},
		"share of all compute": {func(r *JobRequest) { r.Resources.GPU.Share = &GPUShare{MemoryMiB: 1024, ComputePercent: 100} },
			"resources.gpu.share.computePercent", ReasonOutOfRange, "ask for a whole GPU instead"},
		"share of no memory": {func(r *JobRequest) { r.Resources.GPU.Share = &GPUShare{ComputePercent: 50} },
			"resources.gpu.share.memoryMiB", ReasonOutOfRange, "share memory 0 MiB"},
		"share of absurd memory": {func(r *JobRequest) {
			r.Resources.GPU.Share = &GPUShare{MemoryMiB: MaxGPUMemoryMiB + 1, ComputePercent: 50}
		},
			"resources.gpu.share.memoryMiB", ReasonOutOfRange, "want 1 to 1048576"},
		"negative nodes": {func(r *JobRequest) { r.Resources.GPU.Nodes = -1 },
			"resources.gpu.nodes", ReasonOutOfRange, "nodes is -1; want 0 to 128 machines"},
		"too many nodes": {func(r *JobRequest) { r.Resources.GPU.Count, r.Resources.GPU.Nodes = 258, 129 },
			"resources.gpu.nodes", ReasonOutOfRange, "nodes is 129"},
		"mig over machines": {func(r *JobRequest) { r.Resources.GPU.MIGProfile, r.Resources.GPU.Nodes = "1g.10gb", 2 },
			"resources.gpu.nodes", ReasonInvalidValue, "runs on one machine"},
		"share over machines": {func(r *JobRequest) {
			r.Resources.GPU.Share, r.Resources.GPU.Nodes = &GPUShare{MemoryMiB: 1, ComputePercent: 1}, 2
		}, "resources.gpu.nodes", ReasonInvalidValue, "runs on one machine"},
		"uneven gang": {func(r *JobRequest) { r.Resources.GPU.Count, r.Resources.GPU.Nodes = 8, 3 },
			"resources.gpu.nodes", ReasonInvalidValue, "count 8 does not split evenly over 3 machines"},
		"fewer gpus than machines": {func(r *JobRequest) { r.Resources.GPU.Count, r.Resources.GPU.Nodes = 2, 4 },
			"resources.gpu.nodes", ReasonInvalidValue, "count 2 does not split evenly over 4 machines"},
		"unknown topology": {func(r *JobRequest) { r.Resources.GPU.Topology = "ring" },
			"resources.gpu.topology", ReasonInvalidValue, `unknown topology "ring"`},
		"too many selector labels": {func(r *JobRequest) {
			r.NodeSelector = map[string]string{}
			for i := range MaxSelectorLabels + 1 {
				r.NodeSelector["k"+strconv.Itoa(i)] = "v"
			}
		}, "nodeSelector", ReasonOutOfRange, "33 labels, limit is 32"},
		"empty selector key": {func(r *JobRequest) { r.NodeSelector = map[string]string{"": "a"} },
			"nodeSelector", ReasonInvalidValue, `label "" is empty`},
		"long selector label": {func(r *JobRequest) { r.NodeSelector = map[string]string{"zone": strings.Repeat("a", MaxLabelBytes)} },
			"nodeSelector", ReasonInvalidValue, `label "zone" is empty or longer than 256 bytes`},
		"too many tolerations": {func(r *JobRequest) {
			r.Tolerations = make([]Toleration, MaxTolerations+1)
			for i := range r.Tolerations {
				r.Tolerations[i] = Toleration{Operator: TolerationExists}
			}
		}, "tolerations", ReasonOutOfRange, "33 tolerations, limit is 32"},
		"equal without key": {func(r *JobRequest) {
			r.Tolerations = []Toleration{{Key: "a", Operator: TolerationExists}, {Operator: TolerationEqual, Value: "x"}}
		}, "tolerations[1]", ReasonInvalidValue, "operator Equal needs a key"},
		"default operator without key": {func(r *JobRequest) { r.Tolerations = []Toleration{{Value: "x"}} },
			"tolerations[0]", ReasonInvalidValue, "operator Equal needs a key"},
		"exists with a value": {func(r *JobRequest) { r.Tolerations = []Toleration{{Key: "a", Operator: TolerationExists, Value: "x"}} },
			"tolerations[0]", ReasonInvalidValue, "operator Exists takes no value"},
		"unknown operator": {func(r *JobRequest) { r.Tolerations = []Toleration{{Key: "a", Operator: "In", Value: "x"}} },
			"tolerations[0]", ReasonInvalidValue, `unknown operator "In"; want Equal or Exists`},
		"unknown effect": {func(r *JobRequest) { r.Tolerations = []Toleration{{Key: "a", Value: "x", Effect: "NoExecute"}} },
			"tolerations[0]", ReasonInvalidValue, `unknown effect "NoExecute"`},
		"too many dependencies": {func(r *JobRequest) {
			r.DependsOn = manyStrings(MaxDependsOn+1, func(i int) string { return "d" + strconv.Itoa(i) })
		}, "dependsOn", ReasonOutOfRange, "65 dependencies, limit is 64"},
		"dependency with a dot": {func(r *JobRequest) { r.DependsOn = []string{"ok", "a.b"} },
			"dependsOn", ReasonInvalidID, `invalid id "a.b"`},
		"empty dependency": {func(r *JobRequest) { r.DependsOn = []string{""} },
			"dependsOn", ReasonInvalidID, `invalid id ""`},
		"depends on itself": {func(r *JobRequest) { r.DependsOn = []string{"train-1"} },
			"dependsOn", ReasonDependencyCycle, `job "train-1" depends on itself`},
		"negative placement timeout": {func(r *JobRequest) { r.PlacementTimeout = Duration(-time.Second) },
			"placementTimeout", ReasonOutOfRange, "placement timeout -1s; want 0 (none) to 168h0m0s"},
		"placement timeout past a week": {func(r *JobRequest) { r.PlacementTimeout = Duration(MaxPlacementWait + time.Second) },
			"placementTimeout", ReasonOutOfRange, "placement timeout 168h0m1s"},
		"negative expected run time": {func(r *JobRequest) { r.ExpectedRunTime = Duration(-time.Minute) },
			"expectedRunTime", ReasonOutOfRange, "expected run time -1m0s; want 0 (unknown) to 720h0m0s"},
		"expected run time past the limit": {func(r *JobRequest) { r.ExpectedRunTime = Duration(MaxExpectedRunTime + time.Hour) },
			"expectedRunTime", ReasonOutOfRange, "expected run time 721h0m0s"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			r := schedRequest(tt.mod)
			err := r.Validate("acme")
			ve, ok := errors.AsType[*ValidationError](err)
			if !ok {
				t.Fatalf("Validate = %v, want a *ValidationError", err)
			}
			for _, f := range ve.Fields {
				if f.Field == tt.field && f.Reason == tt.reason && strings.Contains(f.Message, tt.message) {
					return
				}
			}
			t.Fatalf("errors %v lack %s on %q with a message containing %q", ve.Fields, tt.reason, tt.field, tt.message)
		})
	}
}

// TestDecodeNamesTheBadDuration: encoding/json does not say which field a
// Duration failed on; the decoder must still name it.
func TestDecodeNamesTheBadDuration(t *testing.T) {
	tests := map[string]struct{ body, field string }{
		"run duration":      {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"soon"}}`, "run.duration"},
		"placement timeout": {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s"},"placementTimeout":"soon"}`, "placementTimeout"},
		"expected run time": {`{"id":"a","expectedRunTime":true,"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "expectedRunTime"},
		"run not an object": {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s"},"expectedRunTime":"1 hour"}`, "expectedRunTime"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeJobRequest([]byte(tt.body), "acme")
			ve, ok := errors.AsType[*ValidationError](err)
			if !ok || len(ve.Fields) != 1 || ve.Fields[0].Field != tt.field || ve.Fields[0].Reason != ReasonInvalidDuration {
				t.Fatalf("DecodeJobRequest = %v; want one invalid_duration on %s", err, tt.field)
			}
		})
	}
	r, err := DecodeJobRequest([]byte(`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s"},"placementTimeout":"90m","expectedRunTime":"1h"}`), "acme")
	if err != nil || r.PlacementTimeout.D() != 90*time.Minute || r.ExpectedRunTime.D() != time.Hour {
		t.Fatalf("DecodeJobRequest = %+v, %v; want 90m and 1h", r, err)
	}
}

func TestTolerates(t *testing.T) {
	spot := Taint{Key: "spot", Value: "true", Effect: TaintNoSchedule}
	tests := map[string]struct {
		tol  Toleration
		want bool
	}{
		"equal, same value, any effect":  {Toleration{Key: "spot", Value: "true"}, true},
		"equal named, same effect":       {Toleration{Key: "spot", Operator: TolerationEqual, Value: "true", Effect: TaintNoSchedule}, true},
		"equal, other value":             {Toleration{Key: "spot", Value: "false"}, false},
		"equal, empty value":             {Toleration{Key: "spot"}, false},
		"equal, other key":               {Toleration{Key: "dedicated", Value: "true"}, false},
		"equal, other effect":            {Toleration{Key: "spot", Value: "true", Effect: TaintPreferNoSchedule}, false},
		"exists, same key":               {Toleration{Key: "spot", Operator: TolerationExists}, true},
		"exists, other key":              {Toleration{Key: "dedicated", Operator: TolerationExists}, false},
		"exists, other effect":           {Toleration{Key: "spot", Operator: TolerationExists, Effect: TaintPreferNoSchedule}, false},
		"exists, no key: everything":     {Toleration{Operator: TolerationExists}, true},
		"exists, no key, same effect":    {Toleration{Operator: TolerationExists, Effect: TaintNoSchedule}, true},
		"exists, no key, other effect":   {Toleration{Operator: TolerationExists, Effect: TaintPreferNoSchedule}, false},
		"equal, no key: nothing (valid)": {Toleration{Value: "true"}, false},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if got := tt.tol.Tolerates(spot); got != tt.want {
				t.Fatalf("%+v.Tolerates(%+v) = %v, want %v", tt.tol, spot, got, tt.want)
			}
		})
	}
	// A taint without a value is matched by Equal with an empty value.
	if !(Toleration{Key: "gpu-test"}).Tolerates(Taint{Key: "gpu-test", Effect: TaintNoSchedule}) {
		t.Error("Equal with an empty value does not tolerate a taint without a value")
	}
}

func TestTolerated(t *testing.T) {
	spot := Taint{Key: "spot", Value: "true", Effect: TaintNoSchedule}
	test := Taint{Key: "gpu-test", Effect: TaintNoSchedule}
	soft := Taint{Key: "old-driver", Effect: TaintPreferNoSchedule}
	tolSpot := Toleration{Key: "spot", Value: "true"}
	tolTest := Toleration{Key: "gpu-test", Operator: TolerationExists}
	tests := map[string]struct {
		tols   []Toleration
		taints []Taint
		effect TaintEffect
		want   bool
	}{
		"no taints":                       {nil, nil, TaintNoSchedule, true},
		"untolerated taint":               {nil, []Taint{spot}, TaintNoSchedule, false},
		"one of two tolerated":            {[]Toleration{tolSpot}, []Taint{spot, test}, TaintNoSchedule, false},
		"both tolerated":                  {[]Toleration{tolTest, tolSpot}, []Taint{spot, test}, TaintNoSchedule, true},
		"other effect ignored":            {[]Toleration{tolSpot}, []Taint{spot, soft}, TaintNoSchedule, true},
		"prefer effect, untolerated":      {[]Toleration{tolSpot}, []Taint{spot, soft}, TaintPreferNoSchedule, false},
		"prefer effect, only hard taints": {nil, []Taint{spot, test}, TaintPreferNoSchedule, true},
		"tolerate everything":             {[]Toleration{{Operator: TolerationExists}}, []Taint{spot, test, soft}, TaintNoSchedule, true},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if got := Tolerated(tt.tols, tt.taints, tt.effect); got != tt.want {
				t.Fatalf("Tolerated = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestSelected(t *testing.T) {
	labels := map[string]string{"zone": "a", "purpose": "training", "empty": ""}
	tests := map[string]struct {
		selector, labels map[string]string
		want             bool
	}{
		"nil selector":           {nil, labels, true},
		"nil selector, nil node": {nil, nil, true},
		"one match":              {map[string]string{"zone": "a"}, labels, true},
		"all match":              {map[string]string{"zone": "a", "purpose": "training"}, labels, true},
		"one of two":             {map[string]string{"zone": "a", "purpose": "inference"}, labels, false},
		"missing key":            {map[string]string{"rack": "r1"}, labels, false},
		"empty value present":    {map[string]string{"empty": ""}, labels, true},
		"empty value missing":    {map[string]string{"rack": ""}, labels, false},
		"node without labels":    {map[string]string{"zone": "a"}, nil, false},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if got := Selected(tt.selector, tt.labels); got != tt.want {
				t.Fatalf("Selected(%v, %v) = %v, want %v", tt.selector, tt.labels, got, tt.want)
			}
		})
	}
}

func quotaMax(v float64) *float64 { return &v }

func TestTenantQuotaValidate(t *testing.T) {
	valid := map[string]TenantQuota{
		"empty":           {},
		"named":           {Tenant: "acme", Weight: 2, StrictFIFO: true},
		"weight bounds":   {Weight: 1000},
		"pools":           {Pools: map[string]PoolQuota{"h100": {Guarantee: 8, Max: quotaMax(16.0)}, QuotaAllPools: {Guarantee: 0.5}}},
		"max = guarantee": {Pools: map[string]PoolQuota{"l4": {Guarantee: 4, Max: quotaMax(4.0)}}},
		"max 0 pins out":  {Pools: map[string]PoolQuota{"l4": {Max: quotaMax(0.0)}}},
		"largest":         {Pools: map[string]PoolQuota{"l4": {Guarantee: 1e6, Max: quotaMax(1e6)}}},
	}
	for name, q := range valid {
		t.Run(name, func(t *testing.T) {
			if err := q.Validate("acme"); err != nil {
				t.Fatalf("Validate: %v", err)
			}
		})
	}
	invalid := map[string]struct {
		tenant  string
		q       TenantQuota
		field   string
		reason  Reason
		message string
	}{
		"bad tenant":         {"Acme", TenantQuota{}, "tenant", ReasonInvalidTenant, `invalid tenant "Acme"`},
		"other tenant":       {"acme", TenantQuota{Tenant: "beta"}, "tenant", ReasonTenantMismatch, `quota names tenant "beta" but is stored for "acme"`},
		"negative weight":    {"acme", TenantQuota{Weight: -1}, "weight", ReasonOutOfRange, "weight -1; want 0 (default 1) to 1000"},
		"huge weight":        {"acme", TenantQuota{Weight: 1001}, "weight", ReasonOutOfRange, "weight 1001"},
		"bad pool":           {"acme", TenantQuota{Pools: map[string]PoolQuota{"H100.x": {}}}, "pools.H100.x", ReasonInvalidValue, `invalid pool "H100.x"`},
		"empty pool":         {"acme", TenantQuota{Pools: map[string]PoolQuota{"": {}}}, "pools.", ReasonInvalidValue, `invalid pool ""`},
		"negative guarantee": {"acme", TenantQuota{Pools: map[string]PoolQuota{"h100": {Guarantee: -1}}}, "pools.h100.guarantee", ReasonOutOfRange, "guarantee -1 GPUs"},
		"huge guarantee":     {"acme", TenantQuota{Pools: map[string]PoolQuota{"*": {Guarantee: 2e6}}}, "pools.*.guarantee", ReasonOutOfRange, "want 0 to 1e6"},
		"max under guarantee": {"acme", TenantQuota{Pools: map[string]PoolQuota{"h100": {Guarantee: 8, Max: quotaMax(4.0)}}},
			"pools.h100.max", ReasonOutOfRange, "max 4 GPUs; want at least the guarantee (8)"},
		"negative max": {"acme", TenantQuota{Pools: map[string]PoolQuota{"h100": {Max: quotaMax(-1.0)}}}, "pools.h100.max", ReasonOutOfRange, "max -1 GPUs"},
		"huge max":     {"acme", TenantQuota{Pools: map[string]PoolQuota{"h100": {Max: quotaMax(1e7)}}}, "pools.h100.max", ReasonOutOfRange, "at most 1e6"},
	}
	for name, tt := range invalid {
		t.Run(name, func(t *testing.T) {
			err := tt.q.Validate(tt.tenant)
			ve, ok := errors.AsType[*ValidationError](err)
			if !ok {
				t.Fatalf("Validate = %v, want a *ValidationError", err)
			}
			for _, f := range ve.Fields {
				if f.Field == tt.field && f.Reason == tt.reason && strings.Contains(f.Message, tt.message) {
					return
				}
			}
			t.Fatalf("errors %v lack %s on %q with %q", ve.Fields, tt.reason, tt.field, tt.message)
		})
	}
	// Every problem at once, in pool order.
	q := TenantQuota{Weight: -2, Pools: map[string]PoolQuota{"b": {Guarantee: -1}, "a": {Guarantee: 2, Max: quotaMax(1.0)}}}
	ve, ok := errors.AsType[*ValidationError](q.Validate("acme"))
	if !ok || ve.Reason != ReasonOutOfRange || len(ve.Fields) != 3 || ve.Fields[1].Field != "pools.a.max" || ve.Fields[2].Field != "pools.b.guarantee" {
		t.Fatalf("Validate = %+v; want weight, pools.a.max, pools.b.guarantee", ve)
	}
}

func TestTenantQuotaForAndWeight(t *testing.T) {
	q := TenantQuota{Pools: map[string]PoolQuota{"h100": {Guarantee: 8}, QuotaAllPools: {Guarantee: 1, Max: quotaMax(2.0)}}}
	tests := map[string]struct {
		q      TenantQuota
		pool   string
		want   PoolQuota
		wantOK bool
	}{
		"own entry":            {q, "h100", PoolQuota{Guarantee: 8}, true},
		"all pools":            {q, "l4", PoolQuota{Guarantee: 1, Max: quotaMax(2.0)}, true},
		"no entry, no default": {TenantQuota{Pools: map[string]PoolQuota{"h100": {Guarantee: 8}}}, "l4", PoolQuota{}, false},
		"no pools":             {TenantQuota{}, "h100", PoolQuota{}, false},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			got, ok := tt.q.For(tt.pool)
			if ok != tt.wantOK {
				t.Fatalf("For(%s) ok = %v, want %v", tt.pool, ok, tt.wantOK)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Fatalf("For(%s) (-want +got):\n%s", tt.pool, diff)
			}
		})
	}
	for w, want := range map[float64]float64{0: 1, -3: 1, 0.5: 0.5, 2: 2, 1000: 1000} {
		if got := (TenantQuota{Weight: w}).EffectiveWeight(); got != want {
			t.Errorf("EffectiveWeight of weight %g = %g, want %g", w, got, want)
		}
	}
}

func TestPoolConfigValidate(t *testing.T) {
	for _, p := range PlacementPolicies {
		if err := (PoolConfig{Policy: p}).Validate("h100"); err != nil {
			t.Errorf("policy %s: %v", p, err)
		}
		if !p.Valid() {
			t.Errorf("%s.Valid() = false", p)
		}
	}
	if err := (PoolConfig{Pool: "h100", Policy: PolicySpread}).Validate("h100"); err != nil {
		t.Errorf("named pool: %v", err)
	}
	tests := map[string]struct {
		pool    string
		c       PoolConfig
		field   string
		message string
	}{
		"unknown policy": {"h100", PoolConfig{Policy: "random"}, "policy", `unknown policy "random"; want one of [binpack spread topology fragaware]`},
		"no policy":      {"h100", PoolConfig{}, "policy", `unknown policy ""`},
		"bad pool":       {"H100", PoolConfig{Policy: PolicyBinpack}, "pool", `invalid pool "H100"`},
		"all pools":      {QuotaAllPools, PoolConfig{Policy: PolicyBinpack}, "pool", `invalid pool "*"`},
		"other pool":     {"h100", PoolConfig{Pool: "l4", Policy: PolicyBinpack}, "pool", `config names pool "l4" but is stored for "h100"`},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			ve, ok := errors.AsType[*ValidationError](tt.c.Validate(tt.pool))
			if !ok || len(ve.Fields) != 1 || ve.Fields[0].Field != tt.field || ve.Fields[0].Reason != ReasonInvalidValue ||
				!strings.Contains(ve.Fields[0].Message, tt.message) {
				t.Fatalf("Validate = %+v; want invalid_value on %s with %q", ve, tt.field, tt.message)
			}
		})
	}
}

func TestGPURequestShape(t *testing.T) {
	tests := map[string]struct {
		g        GPURequest
		kind     GPUKind
		models   []string
		machines int
		milli    int64
	}{
		"one whole":       {GPURequest{Count: 1}, GPUKindWhole, nil, 1, 1000},
		"eight of a kind": {GPURequest{Count: 8, Model: "H100-80GB"}, GPUKindWhole, []string{"H100-80GB"}, 1, 8000},
		"any model":       {GPURequest{Count: 2, Model: GPUModelAny}, GPUKindWhole, nil, 1, 2000},
		"models":          {GPURequest{Count: 2, Models: []string{"L4", "T4"}}, GPUKindWhole, []string{"L4", "T4"}, 1, 2000},
		"models over any": {GPURequest{Count: 1, Model: GPUModelAny, Models: []string{"L4"}}, GPUKindWhole, []string{"L4"}, 1, 1000},
		"gang":            {GPURequest{Count: 16, Nodes: 2}, GPUKindWhole, nil, 2, 16000},
		"nodes 0":         {GPURequest{Count: 4, Nodes: 0}, GPUKindWhole, nil, 1, 4000},
		"mig 1g":          {GPURequest{Count: 1, MIGProfile: "1g.10gb"}, GPUKindMIG, nil, 1, 142},
		"mig 3g":          {GPURequest{Count: 1, MIGProfile: "3g.40gb", Model: "A100-80GB"}, GPUKindMIG, []string{"A100-80GB"}, 1, 428},
		"mig 7g":          {GPURequest{Count: 1, MIGProfile: "7g.80gb"}, GPUKindMIG, nil, 1, 1000},
		"mig malformed":   {GPURequest{Count: 1, MIGProfile: "xg.1gb"}, GPUKindMIG, nil, 1, 142},
		"share":           {GPURequest{Count: 1, Share: &GPUShare{MemoryMiB: 4096, ComputePercent: 25}}, GPUKindShare, nil, 1, 250},
		"share 1%":        {GPURequest{Count: 1, Share: &GPUShare{MemoryMiB: 1, ComputePercent: 1}}, GPUKindShare, nil, 1, 10},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if got := tt.g.Kind(); got != tt.kind {
				t.Errorf("Kind = %s, want %s", got, tt.kind)
			}
			if diff := cmp.Diff(tt.models, tt.g.AllowedModels()); diff != "" {
				t.Errorf("AllowedModels (-want +got):\n%s", diff)
			}
			if got := tt.g.Machines(); got != tt.machines {
				t.Errorf("Machines = %d, want %d", got, tt.machines)
			}
			if got := tt.g.MilliGPUs(); got != tt.milli {
				t.Errorf("MilliGPUs = %d, want %d", got, tt.milli)
			}
		})
	}
}

func TestDecodeSchedulingDocuments(t *testing.T) {
	q, err := DecodeTenantQuota([]byte(`{"weight":2,"strictFifo":true,"pools":{"h100":{"guarantee":8,"max":16},"*":{"guarantee":0}}}`), "acme")
	want := TenantQuota{SchemaVersion: SchemaVersion, Tenant: "acme", Weight: 2, StrictFIFO: true,
		Pools: map[string]PoolQuota{"h100": {Guarantee: 8, Max: quotaMax(16.0)}, "*": {}}}
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, q); diff != "" {
		t.Fatalf("DecodeTenantQuota (-want +got):\n%s", diff)
	}
	c, err := DecodePoolConfig([]byte(`{"policy":"spread"}`), "l4")
	if err != nil || c != (PoolConfig{SchemaVersion: SchemaVersion, Pool: "l4", Policy: PolicySpread}) {
		t.Fatalf("DecodePoolConfig = %+v, %v", c, err)
	}
	for name, tt := range map[string]struct {
		err    error
		field  string
		reason Reason
	}{
		"quota unknown field":  {errOf(DecodeTenantQuota([]byte(`{"weigth":2}`), "acme")), "weigth", ReasonUnknownField},
		"quota weight string":  {errOf(DecodeTenantQuota([]byte(`{"weight":"2"}`), "acme")), "weight", ReasonInvalidType},
		"quota max < guar":     {errOf(DecodeTenantQuota([]byte(`{"pools":{"h100":{"guarantee":8,"max":1}}}`), "acme")), "pools.h100.max", ReasonOutOfRange},
		"quota empty":          {errOf(DecodeTenantQuota(nil, "acme")), "", ReasonEmptyBody},
		"pool bad policy":      {errOf(DecodePoolConfig([]byte(`{"policy":"random"}`), "l4")), "policy", ReasonInvalidValue},
		"pool trailing":        {errOf(DecodePoolConfig([]byte(`{"policy":"spread"} x`), "l4")), "", ReasonInvalidJSON},
		"admin unknown field":  {errOf(DecodeNodeAdminRequest([]byte(`{"why":"x"}`))), "why", ReasonUnknownField},
		"admin reason too big": {errOf(DecodeNodeAdminRequest([]byte(`{"reason":"` + strings.Repeat("x", MaxAdminReason+1) + `"}`))), "reason", ReasonOutOfRange},
	} {
		t.Run(name, func(t *testing.T) {
			ve, ok := errors.AsType[*ValidationError](tt.err)
			if !ok || ve.Fields[0].Field != tt.field || ve.Fields[0].Reason != tt.reason {
				t.Fatalf("err = %v; want %s on %q", tt.err, tt.reason, tt.field)
			}
		})
	}
	if r, err := DecodeNodeAdminRequest([]byte(" \n")); err != nil || r.Reason != "" {
		t.Fatalf("empty admin body: %+v, %v", r, err)
	}
	if r, err := DecodeNodeAdminRequest([]byte(`{"reason":"bad fan"}`)); err != nil || r.Reason != "bad fan" {
		t.Fatalf("admin body: %+v, %v", r, err)
	}
}

func errOf[T any](_ T, err error) error { return err }

func TestDecodeNodeAdmin(t *testing.T) {
	tests := []struct {
		name     string
		value    string
		cordoned bool
		wantErr  bool
	}{
		{"a cordon", `{"nodeId":"n1","cordoned":true,"reason":"fan"}`, true, false},
		{"GPU holds only", `{"nodeId":"n1","gpus":{"GPU-1":{"cordoned":true}}}`, false, false},
		{"names another node: the key wins", `{"nodeId":"n9"}`, false, false},
		{"unreadable: held", `{"cordoned":"yes"`, true, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, err := DecodeNodeAdmin("n1", []byte(tc.value))
			if (err != nil) != tc.wantErr || a.NodeID != "n1" || a.Cordoned != tc.cordoned {
				t.Fatalf("got %+v, %v", a, err)
			}
		})
	}
}

func TestIsAllocationPart(t *testing.T) {
	tests := []struct {
		id   string
		want bool
	}{
		{AllocationPartID("acme", "train", 2, 0), true},
		{AllocationPartID("acme", "train", 2, 11), true},
		{AllocationID("acme", "train", 2), false},          // the whole attempt, not a part
		{AllocationPartID("acme", "train", 1, 0), false},   // another attempt
		{AllocationPartID("acme", "train-x", 2, 0), false}, // another job sharing the prefix
		{AllocationID("acme", "train", 2) + "#", false},    // no rank
		{AllocationID("acme", "train", 2) + "#01", false},  // not as AllocationPartID writes it
		{AllocationID("acme", "train", 2) + "#-1", false},  // a negative rank
		{AllocationID("acme", "train", 2) + "#1#2", false}, // trailing garbage
		{AllocationPartID("other", "train", 2, 0), false},  // another tenant
	}
	for _, tc := range tests {
		if got := IsAllocationPart(tc.id, "acme", "train", 2); got != tc.want {
			t.Errorf("IsAllocationPart(%q) = %v, want %v", tc.id, got, tc.want)
		}
	}
}
