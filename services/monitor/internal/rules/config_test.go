package rules

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestDefaultConfigValidates(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatalf("default rules: %v", err)
	}
}

func TestParse(t *testing.T) {
	yamlDoc := `
resolution: 2s
rules:
  - kind: gpu_hot
    scope: gpu
    metric: temp_c
    op: ">"
    threshold: 80
    action: drain_gpu
`
	jsonDoc := `{"resolution": "2s", "rules": [{"kind": "gpu_hot", "scope": "gpu", "metric": "temp_c",
		"op": ">", "threshold": 80, "action": "drain_gpu"}]}`
	want := Config{Resolution: Duration(2 * time.Second), Rules: []Rule{{Kind: "gpu_hot", Scope: ScopeGPU, Metric: MetricTempC,
		Agg: AggLast, Window: Duration(2 * time.Second), Op: OpGT, Threshold: 80, Severity: "warning", Action: ActionDrainGPU}}}
	for name, doc := range map[string]string{"yaml": yamlDoc, "json": jsonDoc} {
		t.Run(name, func(t *testing.T) {
			got, err := Parse([]byte(doc))
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("config (-want +got):\n%s", diff)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	tests := map[string]struct {
		doc  string
		want []string
	}{
		"unknown field": {doc: "rules:\n  - {kind: a, threshhold: 3}\n", want: []string{"threshhold"}},
		"bad duration":  {doc: "resolution: soon\n", want: []string{"soon"}},
		"a kind another service raises": {
			doc: `
rules:
  - {kind: spot_interruption, scope: node, metric: heartbeat_age_s, op: ">"}
  - {kind: budget, scope: tenant, metric: gpu_util, op: ">"}
`,
			want: []string{`"spot_interruption"): kind is raised by another service`, `"budget"): kind is raised by another service`},
		},
		"every problem at once": {
			doc: `
resolution: 2h
rules:
  - {kind: "a.b", scope: rack, metric: fan, agg: p99, op: "!=", window: 2h, for: -1s}
  - {kind: t, scope: gpu, metric: temp_c, op: ">", window: 2s, trend: 1m}
  - {kind: t, scope: gpu, metric: temp_c, op: ">"}
  - {scope: gpu, metric: temp_c, op: ">"}
`,
			want: []string{"resolution 2h0m0s", "one subject token", `scope "rack"`, `metric "fan"`, `agg "p99"`, `op "!="`,
				"window 2h0m0s", "must not be negative", "at least two buckets", "used by another rule", "kind is empty"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := Parse([]byte(tc.doc))
			if err == nil {
				t.Fatal("Parse accepted it")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(path, []byte("rules:\n  - {kind: x, scope: pool, metric: gpu_util, op: \">\", threshold: 1}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := Load(path)
	if err != nil || len(cfg.Rules) != 1 || cfg.Resolution != Duration(5*time.Second) {
		t.Errorf("Load = %+v, %v", cfg, err)
	}
	if _, err := Load(filepath.Join(t.TempDir(), "missing.yaml")); err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Errorf("Load(missing) err = %v", err)
	}
}

// TestDeployedRulesFileIsTheDefault keeps deploy/monitoring/rules.yaml equal
// to the built-in rules it documents.
func TestDeployedRulesFileIsTheDefault(t *testing.T) {
	cfg, err := Load(filepath.Join("..", "..", "..", "..", "deploy", "monitoring", "rules.yaml"))
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if diff := cmp.Diff(DefaultConfig(), cfg); diff != "" {
		t.Errorf("deploy/monitoring/rules.yaml differs from DefaultConfig (-default +file):\n%s", diff)
	}
}
