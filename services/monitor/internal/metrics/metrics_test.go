package metrics

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"gopkg.in/yaml.v3"

	"github.com/gpuplane/gpuplane/services/monitor/internal/rules"
)

var (
	deployDir  = filepath.Join("..", "..", "..", "..", "deploy", "monitoring")
	metricName = regexp.MustCompile(`\b(DCGM_FI_[A-Z_]+|gpuplane_[a-z0-9_]+)\b`)
	fqName     = regexp.MustCompile(`fqName: "([^"]+)"`)
)

// described lists the metric names the collector can emit.
func described(t *testing.T) []string {
	t.Helper()
	ch := make(chan *prometheus.Desc, 100)
	New(nil, nil, 0, nil).Describe(ch)
	close(ch)
	var names []string
	for d := range ch {
		m := fqName.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("no name in %s", d)
		}
		names = append(names, m[1])
	}
	slices.Sort(names)
	return names
}

func referenced(t *testing.T, file string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(deployDir, file))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range metricName.FindAllString(string(b), -1) {
		names = append(names, m)
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// TestDashboardShowsEveryMetric keeps the Grafana dashboard and the
// collector in step: every series it queries exists and every series the
// monitor exports has a panel.
func TestDashboardShowsEveryMetric(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(deployDir, "grafana-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		UID    string            `json:"uid"`
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil || dash.UID == "" || len(dash.Panels) == 0 {
		t.Fatalf("dashboard: uid %q, %d panels, err %v", dash.UID, len(dash.Panels), err)
	}
	if diff := cmp.Diff(described(t), referenced(t, "grafana-dashboard.json")); diff != "" {
		t.Errorf("metrics exported (-) versus shown on the dashboard (+):\n%s", diff)
	}
}

// TestPrometheusRulesMatchTheBuiltInRules checks that the rules file has
// one alert per built-in rule (plus node_silent) over exported series.
func TestPrometheusRulesMatchTheBuiltInRules(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(deployDir, "prometheus-rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Groups []struct {
			Rules []struct {
				Alert  string            `yaml:"alert"`
				Expr   string            `yaml:"expr"`
				Labels map[string]string `yaml:"labels"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(b, &file); err != nil {
		t.Fatalf("prometheus-rules.yaml: %v", err)
	}
	got := map[string]string{}
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			got[r.Alert] = r.Labels["action"]
		}
	}
	want := map[string]string{"node_silent": ""}
	for _, r := range rules.DefaultConfig().Rules {
		want[r.Kind] = r.Action
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("alerts and actions (-built-in +prometheus-rules.yaml):\n%s", diff)
	}
	for _, name := range referenced(t, "prometheus-rules.yaml") {
		if !slices.Contains(described(t), name) {
			t.Errorf("prometheus-rules.yaml reads %s, which the monitor does not export", name)
		}
	}
}
