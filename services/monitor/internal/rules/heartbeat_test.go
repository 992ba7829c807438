package rules

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// nodeLostRule is the built-in node_lost rule.
func nodeLostRule(t *testing.T) Rule {
	t.Helper()
	for _, r := range DefaultConfig().Rules {
		if r.Kind == "node_lost" {
			return r
		}
	}
	t.Fatal("no built-in node_lost rule")
	return Rule{}
}

// TestNodeLost drives the built-in rule with heartbeat ages sampled each
// second, as the monitor samples them: one firing when the age reaches
// three intervals, one resolution when heartbeats come back, and for a
// node that stops being sampled (it left cleanly) a resolution once its
// window is empty, never a firing.
func TestNodeLost(t *testing.T) {
	tests := map[string]struct {
		// age is the node's heartbeat age at second s; ok false: the monitor
		// no longer samples the node.
		age  func(s int) (age time.Duration, ok bool)
		want []string
	}{
		"beating": {
			age:  func(s int) (time.Duration, bool) { return time.Duration(s%2) * time.Second, true },
			want: nil,
		},
		"stops then resumes": {
			age: func(s int) (time.Duration, bool) {
				if s < 10 {
					return time.Duration(s) * time.Second, true // last heartbeat at 0 s
				}
				return 0, true
			},
			want: []string{"6s node_lost n1 1 firing", "10s node_lost n1 1 resolved"},
		},
		"leaves cleanly before three intervals": {
			age: func(s int) (time.Duration, bool) {
				return time.Duration(s) * time.Second, s < 4
			},
			want: nil,
		},
		"leaves cleanly while lost": {
			age: func(s int) (time.Duration, bool) {
				return time.Duration(s) * time.Second, s < 8
			},
			// The 5 s window still holds the 7 s sample until 12 s.
			want: []string{"6s node_lost n1 1 firing", "13s node_lost n1 1 resolved"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			d := newDriver(t, Config{Resolution: Duration(time.Second), Rules: []Rule{nodeLostRule(t)}})
			for s := range 20 {
				at := time.Duration(s) * time.Second
				if age, ok := tc.age(s); ok {
					d.e.IngestNode("n1", "h100", t0.Add(at), NodeValues{HeartbeatAge: age})
				}
				d.eval(at)
			}
			if diff := cmp.Diff(tc.want, d.got); diff != "" {
				t.Errorf("transitions (-want +got):\n%s", diff)
			}
		})
	}
}

// TestNodeLostLabels checks the alert of a node first met through its
// heartbeats, whose pool became known later.
func TestNodeLostLabels(t *testing.T) {
	e, err := New(Config{Resolution: Duration(time.Second), Rules: []Rule{nodeLostRule(t)}})
	if err != nil {
		t.Fatal(err)
	}
	e.IngestNode("n1", "", t0, NodeValues{HeartbeatAge: time.Second})
	if tr := e.Evaluate(t0); len(tr) != 0 {
		t.Fatalf("Evaluate = %+v, want nothing", tr)
	}
	e.IngestNode("n1", "h100", t0.Add(time.Second), NodeValues{HeartbeatAge: 7 * time.Second})
	tr := e.Evaluate(t0.Add(time.Second))
	if len(tr) != 1 {
		t.Fatalf("Evaluate = %+v, want one firing", tr)
	}
	a := tr[0].Alert()
	want := map[string]string{contracts.AlertLabelNode: "n1", contracts.AlertLabelPool: "h100",
		contracts.AlertLabelScope: "node", contracts.AlertLabelEpisode: "1"}
	if diff := cmp.Diff(want, a.Labels); diff != "" {
		t.Errorf("labels (-want +got):\n%s", diff)
	}
	if a.Kind != "node_lost" || a.Key != "n1" || a.State != contracts.AlertFiring || a.Severity != "critical" || a.Value != 7 {
		t.Errorf("alert = %+v", a)
	}
	if id := tr[0].ID(); id != "alert/node_lost/n1/1/firing" {
		t.Errorf("ID = %q", id)
	}
}

func TestHeartbeatAgeIsANodeMetric(t *testing.T) {
	_, err := Parse([]byte(`rules: [{kind: x, scope: pool, metric: heartbeat_age_s, op: ">=", threshold: 6}]`))
	if err == nil || !strings.Contains(fmt.Sprint(err), "want scope node") {
		t.Errorf("Parse = %v, want a scope error", err)
	}
}
