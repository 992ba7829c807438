package rules

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// driver feeds an engine telemetry at offsets from t0 and records every
// transition as "offset kind key episode state".
type driver struct {
	t   *testing.T
	e   *Engine
	got []string
	// tenants maps allocation IDs to tenants, as the ledger would.
	tenants map[string]string
}

func newDriver(t *testing.T, cfg Config) *driver {
	t.Helper()
	e, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return &driver{t: t, e: e, tenants: map[string]string{}}
}

func (d *driver) ingest(at time.Duration, node, pool string, gpus ...contracts.GPUSample) {
	d.e.Ingest(Machine{Node: node, Hostname: "host-" + node, Pool: pool}, t0.Add(at), gpus,
		func(id string) string { return d.tenants[id] })
}

func (d *driver) eval(at time.Duration) {
	for _, tr := range d.e.Evaluate(t0.Add(at)) {
		d.got = append(d.got, fmt.Sprintf("%s %s %s %d %s", at, tr.Kind, tr.Key, tr.Episode, tr.State))
	}
}

// each ingests and evaluates every second from from to to (inclusive),
// the samples given by gpus for that second.
func (d *driver) each(from, to time.Duration, node, pool string, gpus func(at time.Duration) []contracts.GPUSample) {
	for at := from; at <= to; at += time.Second {
		d.ingest(at, node, pool, gpus(at)...)
		d.eval(at)
	}
}

func g(uuid string, f func(*contracts.GPUSample)) contracts.GPUSample {
	s := contracts.GPUSample{UUID: uuid, Model: "H100-80GB", Healthy: true, FBFreeMiB: 80000, TempC: 50, GPUUtil: 10}
	if f != nil {
		f(&s)
	}
	return s
}

func temp(c float64) func(*contracts.GPUSample) { return func(s *contracts.GPUSample) { s.TempC = c } }
func util(u float64) func(*contracts.GPUSample) {
	return func(s *contracts.GPUSample) { s.GPUUtil = u }
}

func only(kinds ...string) Config {
	cfg := DefaultConfig()
	var rules []Rule
	for _, r := range cfg.Rules {
		for _, k := range kinds {
			if r.Kind == k {
				rules = append(rules, r)
			}
		}
	}
	cfg.Rules = rules
	return cfg
}

func TestDefaultRules(t *testing.T) {
	const s = time.Second
	tests := map[string]struct {
		cfg   Config
		drive func(d *driver)
		want  []string
	}{
		"gpu_hot fires at once above 85 and resolves once, each episode once": {
			cfg: only("gpu_hot"),
			drive: func(d *driver) {
				d.each(0, 2*s, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", temp(85))} })
				d.each(3*s, 5*s, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", temp(86))} })
				d.each(6*s, 7*s, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", temp(70))} })
				d.each(8*s, 8*s, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", temp(90))} })
			},
			want: []string{"3s gpu_hot G1 1 firing", "6s gpu_hot G1 1 resolved", "8s gpu_hot G1 2 firing"},
		},
		"gpu_memory_high needs a full minute above 90%": {
			cfg: only("gpu_memory_high"),
			drive: func(d *driver) {
				full := func(s *contracts.GPUSample) { s.FBUsedMiB, s.FBFreeMiB = 95, 5 }
				d.each(0, 59*s, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", full)} })
				// A dip resets the pending time.
				d.each(60*s, 60*s, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", nil)} })
				d.each(61*s, 125*s, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", full)} })
			},
			want: []string{"2m1s gpu_memory_high G1 1 firing"},
		},
		"pool_util_high: the pool's mean over a minute, held for five": {
			cfg: only("pool_util_high"),
			drive: func(d *driver) {
				// Two machines, three GPUs: 95% everywhere, but n2 idles
				// for the first 30 s, which keeps the window's mean below 90
				// until it has slid past most of that: at 83 s the window
				// (buckets from 20 s) holds 10 idle samples of 192, mean
				// 90.05. Pending from 83 s, it fires 5 min later.
				for at := time.Duration(0); at <= 7*time.Minute; at += s {
					u2 := 95.0
					if at < 30*s {
						u2 = 0
					}
					d.ingest(at, "n1", "h100", g("A", util(95)), g("B", util(95)))
					d.ingest(at, "n2", "h100", g("C", util(u2)))
					d.ingest(at, "n3", "a100", g("D", util(100)))
					d.eval(at)
				}
				// The a100 pool has only been at 100% since 0: it fires at 5 min.
			},
			want: []string{"5m0s pool_util_high a100 1 firing", "6m23s pool_util_high h100 1 firing"},
		},
		"gpu_xid and gpu_ecc_dbe mark the GPU unhealthy": {
			cfg: only("gpu_xid", "gpu_ecc_dbe"),
			drive: func(d *driver) {
				d.each(0, 1*s, "n1", "p", func(time.Duration) []contracts.GPUSample {
					return []contracts.GPUSample{g("G1", nil), g("G2", nil)}
				})
				d.each(2*s, 3*s, "n1", "p", func(time.Duration) []contracts.GPUSample {
					return []contracts.GPUSample{g("G1", func(s *contracts.GPUSample) { s.LastXID = 79 }),
						g("G2", func(s *contracts.GPUSample) { s.ECCDBE = 1 })}
				})
			},
			want: []string{"2s gpu_ecc_dbe G2 1 firing", "2s gpu_xid G1 1 firing"},
		},
		"gpu_temp_rising warns before gpu_hot, then yields to it": {
			cfg: only("gpu_temp_rising", "gpu_hot"),
			drive: func(d *driver) {
				// 0.05 °C/s from 76 °C: +15 °C in 5 min, so 85 is on course
				// all along, but the GPU passes the 80 °C floor only after
				// 80 s; warned a minute later; 85 crossed after 180 s.
				d.each(0, 200*s, "n1", "p", func(at time.Duration) []contracts.GPUSample {
					return []contracts.GPUSample{g("G1", temp(76+at.Seconds()/20))}
				})
			},
			want: []string{"2m21s gpu_temp_rising G1 1 firing", "3m1s gpu_hot G1 1 firing", "3m1s gpu_temp_rising G1 1 resolved"},
		},
		"gpu_temp_rising stays quiet while a GPU warms up from idle": {
			cfg: only("gpu_temp_rising"),
			drive: func(d *driver) {
				// The simulated fleet's warm-up: from 32 °C towards a
				// working 74 °C with a 40 s time constant. The trend alone
				// projects 85 °C within 5 minutes for the first minute and
				// more; the floor keeps it quiet.
				d.each(0, 5*time.Minute, "n1", "p", func(at time.Duration) []contracts.GPUSample {
					return []contracts.GPUSample{g("G1", temp(74-42*math.Exp(-at.Seconds()/40)))}
				})
			},
		},
		"gpu_temp_rising stays quiet when the rise is slow": {
			cfg: only("gpu_temp_rising"),
			drive: func(d *driver) {
				d.each(0, 200*s, "n1", "p", func(at time.Duration) []contracts.GPUSample {
					return []contracts.GPUSample{g("G1", temp(60+at.Seconds()/100))}
				})
			},
		},
		"gpu_ecc_sbe_rising: a rising counter warns, a steady one does not": {
			cfg: only("gpu_ecc_sbe_rising"),
			drive: func(d *driver) {
				d.each(0, 20*s, "n1", "p", func(at time.Duration) []contracts.GPUSample {
					sbe := int64(3)
					if at >= 10*s {
						sbe = 4
					}
					return []contracts.GPUSample{g("G1", func(s *contracts.GPUSample) { s.ECCSBE = sbe }),
						g("G2", func(s *contracts.GPUSample) { s.ECCSBE = 7 })}
				})
			},
			want: []string{"10s gpu_ecc_sbe_rising G1 1 firing"},
		},
		"a silent GPU's alert resolves when its window empties": {
			cfg: only("gpu_hot"),
			drive: func(d *driver) {
				d.each(0, 0, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", temp(95))} })
				for at := s; at <= 12*s; at += s {
					d.eval(at)
				}
			},
			want: []string{"0s gpu_hot G1 1 firing", "10s gpu_hot G1 1 resolved"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			d := newDriver(t, tc.cfg)
			tc.drive(d)
			if diff := cmp.Diff(tc.want, d.got); diff != "" {
				t.Errorf("transitions (-want +got):\n%s", diff)
			}
		})
	}
}

func TestTenantAndNodeScopes(t *testing.T) {
	cfg, err := Parse([]byte(`
resolution: 1s
rules:
  - {kind: tenant_busy, scope: tenant, metric: gpu_util, agg: avg, window: 10s, op: ">=", threshold: 80}
  - {kind: node_idle, scope: node, metric: gpu_util, agg: max, window: 10s, op: "<", threshold: 5, for: 5s}
`))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	d := newDriver(t, cfg)
	d.tenants["a1"] = "acme"
	d.tenants["a2"] = "beta"
	alloc := func(id string, u float64) func(*contracts.GPUSample) {
		return func(s *contracts.GPUSample) { s.AllocationID, s.GPUUtil = id, u }
	}
	d.each(0, 6*time.Second, "n1", "p", func(time.Duration) []contracts.GPUSample {
		// acme holds two GPUs at 90 and 70: mean 80; beta one at 50;
		// the idle GPU belongs to no tenant.
		return []contracts.GPUSample{g("A", alloc("a1", 90)), g("B", alloc("a1", 70)), g("C", alloc("a2", 50)), g("D", util(0))}
	})
	d.each(0, 6*time.Second, "n2", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("E", util(1))} })
	want := []string{"0s tenant_busy acme 1 firing", "5s node_idle n2 1 firing"}
	if diff := cmp.Diff(want, d.got); diff != "" {
		t.Errorf("transitions (-want +got):\n%s", diff)
	}
	if got := d.e.Utilisation(t0.Add(6*time.Second), t0, ScopeTenant); len(got) != 2 || got[0].Key != "acme" || got[0].Mean != 80 ||
		got[1].Key != "beta" || got[1].Mean != 50 {
		t.Errorf("tenant utilisation = %+v", got)
	}
}

func TestTransitionAlert(t *testing.T) {
	d := newDriver(t, only("gpu_hot"))
	d.ingest(0, "n1", "h100", g("GPU-1", temp(91)))
	trs := d.e.Evaluate(t0)
	if len(trs) != 1 {
		t.Fatalf("transitions = %+v", trs)
	}
	tr := trs[0]
	if got, want := tr.ID(), "alert/gpu_hot/GPU-1/1/firing"; got != want {
		t.Errorf("ID = %q, want %q", got, want)
	}
	a := tr.Alert()
	wantLabels := map[string]string{"action": "drain_gpu", "episode": "1", "gpu": "0", "gpu_uuid": "GPU-1", "hostname": "host-n1",
		"model": "H100-80GB", "node": "n1", "pool": "h100", "scope": "gpu"}
	if diff := cmp.Diff(wantLabels, a.Labels); diff != "" {
		t.Errorf("labels (-want +got):\n%s", diff)
	}
	if a.Kind != "gpu_hot" || a.Key != "GPU-1" || a.State != contracts.AlertFiring || a.Severity != "critical" ||
		a.Value != 91 || !a.Since.Equal(t0) || !a.Time.Equal(t0) || !strings.Contains(a.Message, "85") {
		t.Errorf("alert = %+v", a)
	}
}

func TestRestore(t *testing.T) {
	fired := contracts.Alert{Kind: "gpu_hot", Key: "G1", State: contracts.AlertFiring, Since: t0,
		Labels: map[string]string{contracts.AlertLabelEpisode: "3"}}
	resolved := fired
	resolved.State = contracts.AlertResolved
	tests := map[string]struct {
		restore []contracts.Alert
		drive   func(d *driver)
		want    []string
	}{
		"an open episode still hot is not fired again; its end is episode 3": {
			restore: []contracts.Alert{fired},
			drive: func(d *driver) {
				d.each(0, 1*time.Second, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", temp(90))} })
				d.each(2*time.Second, 2*time.Second, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", temp(50))} })
			},
			want: []string{"2s gpu_hot G1 3 resolved"},
		},
		"a closed episode is followed by episode 4": {
			restore: []contracts.Alert{fired, resolved},
			drive: func(d *driver) {
				d.each(0, 0, "n1", "p", func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", temp(90))} })
			},
			want: []string{"0s gpu_hot G1 4 firing"},
		},
		"an open episode whose GPU never reports again resolves after the span": {
			// The longest ring (the 1 min utilisation summary) plus two
			// buckets: 70 s after the first evaluation that missed it.
			restore: []contracts.Alert{fired},
			drive: func(d *driver) {
				for at := time.Duration(0); at <= 100*time.Second; at += 5 * time.Second {
					d.eval(at)
				}
			},
			want: []string{"1m15s gpu_hot G1 3 resolved"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			d := newDriver(t, only("gpu_hot"))
			for _, a := range tc.restore {
				if ours, err := d.e.Restore(a); !ours || err != nil {
					t.Fatalf("Restore(%+v) = %v, %v", a, ours, err)
				}
			}
			tc.drive(d)
			if diff := cmp.Diff(tc.want, d.got); diff != "" {
				t.Errorf("transitions (-want +got):\n%s", diff)
			}
		})
	}
	e, _ := New(DefaultConfig())
	if ours, err := e.Restore(contracts.Alert{Kind: "node_silent", Key: "n1"}); ours || err != nil {
		t.Errorf("Restore(node_silent) = %v, %v; want false, nil", ours, err)
	}
	if _, err := e.Restore(contracts.Alert{Kind: "gpu_hot", Key: "G1"}); err == nil || !strings.Contains(err.Error(), "episode") {
		t.Errorf("Restore without episode: err = %v", err)
	}
}

func TestIngestDoesNotAllocate(t *testing.T) {
	e, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	gpus := make([]contracts.GPUSample, 8)
	for i := range gpus {
		gpus[i] = g(fmt.Sprintf("GPU-%d", i), func(s *contracts.GPUSample) { s.Index, s.AllocationID = i, "a1" })
	}
	tenantOf := func(string) string { return "acme" }
	m := Machine{Node: "n1", Hostname: "h1", Pool: "p"}
	at := t0
	e.Ingest(m, at, gpus, tenantOf)
	if n := testing.AllocsPerRun(100, func() {
		at = at.Add(time.Second)
		e.Ingest(m, at, gpus, tenantOf)
	}); n != 0 {
		t.Errorf("Ingest allocates %v times per message", n)
	}
}
