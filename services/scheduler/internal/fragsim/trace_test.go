package fragsim

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const nodeCSV = `sn,cpu_milli,memory_mib,gpu,model
n0,64000,262144,2,P100
n1,96000,393216,8,G2
n2,32000,131072,0,
`

func TestLoadNodes(t *testing.T) {
	nodes, models, err := LoadNodes(strings.NewReader(nodeCSV), "nodes.csv")
	if err != nil {
		t.Fatal(err)
	}
	want := []NodeSpec{
		{Name: "n0", CPUMilli: 64000, MemoryMiB: 262144, GPUs: 2, Model: 0},
		{Name: "n1", CPUMilli: 96000, MemoryMiB: 393216, GPUs: 8, Model: 1},
		{Name: "n2", CPUMilli: 32000, MemoryMiB: 131072, GPUs: 0, Model: 2},
	}
	if diff := cmp.Diff(want, nodes); diff != "" {
		t.Errorf("nodes (-want +got):\n%s", diff)
	}
	if got := models.Name(1); got != "G2" {
		t.Errorf("model 1 = %q, want G2", got)
	}
}

func TestLoadPods(t *testing.T) {
	_, models, err := LoadNodes(strings.NewReader(nodeCSV), "nodes.csv")
	if err != nil {
		t.Fatal(err)
	}
	// Extra columns are ignored; gpu_spec is optional; a spec naming only
	// unknown models leaves an empty set (the task can never be placed).
	const pods = `name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos
p0,12000,16384,1,1000,,LS
p1,6000,12288,1,460,G2|P100,LS
p2,8000,30517,0,0,,BE
p3,4000,1024,8,1000,A100,BE
`
	got, err := LoadPods(strings.NewReader(pods), "pods.csv", models)
	if err != nil {
		t.Fatal(err)
	}
	want := []Pod{
		{Name: "p0", Request: Request{CPUMilli: 12000, MemoryMiB: 16384, GPUs: 1, GPUMilli: 1000, Models: AnyModel}},
		{Name: "p1", Spec: "G2|P100", Request: Request{CPUMilli: 6000, MemoryMiB: 12288, GPUs: 1, GPUMilli: 460, Models: 0b011}},
		{Name: "p2", Request: Request{CPUMilli: 8000, MemoryMiB: 30517, Models: AnyModel}},
		{Name: "p3", Spec: "A100", Request: Request{CPUMilli: 4000, MemoryMiB: 1024, GPUs: 8, GPUMilli: 1000, Models: 0}},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("pods (-want +got):\n%s", diff)
	}
}

// TestParseErrors checks that a bad file is refused with the file, line,
// column and a specific reason.
func TestParseErrors(t *testing.T) {
	const podHeader = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
	tests := map[string]struct {
		nodes bool
		input string
		want  string
	}{
		"empty node file":     {nodes: true, input: "", want: "f.csv:1: empty file: no header"},
		"node header lacks":   {nodes: true, input: "sn,cpu_milli,gpu\nn0,1,1\n", want: "f.csv:1: header lacks column(s) memory_mib, model"},
		"no nodes":            {nodes: true, input: "sn,cpu_milli,memory_mib,gpu,model\n", want: "f.csv:2: no nodes"},
		"node cpu not number": {nodes: true, input: "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,1,2,T4\nn1,lots,1,2,T4\n", want: `f.csv:3: column 2 (cpu_milli): "lots" is not an integer`},
		"node too many gpus":  {nodes: true, input: "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,17,T4\n", want: "f.csv:2: column 4 (gpu): 17 GPUs, at most 16 per node"},
		"duplicate node":      {nodes: true, input: "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,1,T4\nn0,1,1,1,T4\n", want: `f.csv:3: column 1 (sn): node "n0" already listed on line 2`},
		"short record":        {input: podHeader + "p0,1,1,1\n", want: "f.csv:2: 4 fields, header has 5"},
		"negative memory":     {input: podHeader + "p0,1,1,0,0\np1,1,-5,0,0\n", want: "f.csv:3: column 3 (memory_mib): -5 is negative"},
		"share out of range":  {input: podHeader + "p0,1,1,1,1500\n", want: "f.csv:2: column 5 (gpu_milli): GPU share 1500 out of 1..1000"},
		"multi-GPU share":     {input: podHeader + "p0,1,1,2,500\n", want: "f.csv:2: column 5 (gpu_milli): 2 GPUs of 500 milli each: a multi-GPU task takes whole GPUs"},
		"share without GPU":   {input: podHeader + "p0,1,1,0,300\n", want: "f.csv:2: column 5 (gpu_milli): GPU share 300 without a GPU"},
		"bare quote":          {input: podHeader + "p0,1\"2,1,0,0\n", want: `f.csv:2: byte 5: bare " in non-quoted-field`},
		"no pods":             {input: podHeader, want: "f.csv:2: no pods"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var err error
			if tc.nodes {
				_, _, err = LoadNodes(strings.NewReader(tc.input), "f.csv")
			} else {
				_, err = LoadPods(strings.NewReader(tc.input), "f.csv", NewModels())
			}
			if err == nil {
				t.Fatalf("no error, want %q", tc.want)
			}
			if err.Error() != tc.want {
				t.Errorf("error\n got %q\nwant %q", err, tc.want)
			}
			var pe *ParseError
			if !errors.As(err, &pe) {
				t.Errorf("error %T is not a *ParseError", err)
			}
		})
	}
}
