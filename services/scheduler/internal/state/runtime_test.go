package state

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func hostJob(id, pool string) contracts.JobRequest {
	j := job(id, 1, "")
	j.Pool = pool
	j.Run = contracts.RunSpec{Command: []string{"sh", "-c", "true"}}
	return j
}

func imageJob(id, pool, image string, mounts ...contracts.Mount) contracts.JobRequest {
	j := job(id, 1, "")
	j.Pool = pool
	j.Run = contracts.RunSpec{Image: image, Command: []string{"true"}, Mounts: mounts}
	return j
}

func (h *harness) poolConfig(pool string, rt *contracts.PoolRuntime) {
	c := contracts.PoolConfig{Pool: pool, Policy: contracts.PolicyBinpack, Runtime: rt}
	h.fact(func(s *Store) []Publish { s.ApplyPoolConfig(pool, &c); return nil })
}

// TestAdmissionByPoolRuntime: a host command goes only where a pool's
// runtime policy (or the platform's default) allows host commands, mounts
// only where their source lies under a pool's roots; the rejection says
// which rule, on which field.
func TestAdmissionByPoolRuntime(t *testing.T) {
	data := contracts.Mount{Source: "/data/imagenet", Target: "/data", ReadOnly: true}
	etc := contracts.Mount{Source: "/etc", Target: "/etc-host"}
	trusted := &contracts.PoolRuntime{AllowHostCommands: true, MountRoots: []string{"/data"}}
	tests := map[string]struct {
		allowDefault bool
		pools        map[string]*contracts.PoolRuntime
		req          contracts.JobRequest
		reason       contracts.Reason // "" queued
		field        string
	}{
		"image, images-only default":     {false, nil, imageJob("j", "", "busybox"), "", ""},
		"simulated, images-only default": {false, nil, job("j", 1, ""), "", ""},
		"host, images-only default":      {false, nil, hostJob("j", ""), contracts.ReasonHostCommandsNotAllowed, "run.image"},
		"host, default allows":           {true, nil, hostJob("j", ""), "", ""},
		"host, one pool allows":          {false, map[string]*contracts.PoolRuntime{"trusted": trusted}, hostJob("j", ""), "", ""},
		"host, named pool allows":        {false, map[string]*contracts.PoolRuntime{"trusted": trusted}, hostJob("j", "trusted"), "", ""},
		"host, named pool refuses":       {false, map[string]*contracts.PoolRuntime{"trusted": trusted}, hostJob("j", "gpu"), contracts.ReasonHostCommandsNotAllowed, "run.image"},
		"host, named pool overrides default": {true, map[string]*contracts.PoolRuntime{"gpu": {}}, hostJob("j", "gpu"),
			contracts.ReasonHostCommandsNotAllowed, "run.image"},
		"host, pool config without runtime": {true, map[string]*contracts.PoolRuntime{"gpu": nil}, hostJob("j", "gpu"), "", ""},
		"mount under a root":                {false, map[string]*contracts.PoolRuntime{"trusted": trusted}, imageJob("j", "", "busybox", data), "", ""},
		"mount under a named pool's root":   {false, map[string]*contracts.PoolRuntime{"trusted": trusted}, imageJob("j", "trusted", "busybox", data), "", ""},
		"mount outside every root": {false, map[string]*contracts.PoolRuntime{"trusted": trusted}, imageJob("j", "", "busybox", data, etc),
			contracts.ReasonMountNotAllowed, "run.mounts[0].source"},
		"mount, named pool without roots": {true, map[string]*contracts.PoolRuntime{"trusted": trusted}, imageJob("j", "gpu", "busybox", data),
			contracts.ReasonMountNotAllowed, "run.mounts[0].source"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, func(c *Config) { c.AllowHostCommands = tt.allowDefault })
			for pool, rt := range tt.pools {
				h.poolConfig(pool, rt)
			}
			h.submit("acme", tt.req)
			ev := h.last("acme", "j")
			if tt.reason == "" {
				if ev.Type != contracts.EventQueued {
					t.Fatalf("got %s %s %v, want queued", ev.Type, ev.Reason, ev.Errors)
				}
				return
			}
			if ev.Type != contracts.EventRejected || ev.Reason != tt.reason || len(ev.Errors) != 1 || ev.Errors[0].Field != tt.field {
				t.Fatalf("got %s %s %v, want rejected %s on %s", ev.Type, ev.Reason, ev.Errors, tt.reason, tt.field)
			}
		})
	}
}

// TestHostCommandsPlacedOnlyWhereAllowed: with a fleet of an images-only
// pool and a trusted one, a host command goes to the trusted pool even when
// the other is as good a fit, and its allocation carries the pool's policy
// for the agent, as an image's carries its pool's.
func TestHostCommandsPlacedOnlyWhereAllowed(t *testing.T) {
	h := newHarness(t)
	h.inventory("a-images", "images", "H100-80GB", 81920, 8)
	h.inventory("b-trusted", "trusted", "H100-80GB", 81920, 8)
	h.poolConfig("images", &contracts.PoolRuntime{HostNetwork: true})
	h.poolConfig("trusted", &contracts.PoolRuntime{AllowHostCommands: true})
	h.submit("acme", hostJob("host", ""))
	h.submit("acme", imageJob("img", "images", "busybox"))
	h.cycle()
	host, img := h.item("acme", "host"), h.item("acme", "img")
	if host.NodeID != "b-trusted" {
		t.Fatalf("host command placed on %s, want b-trusted (pool images runs images only)", host.NodeID)
	}
	if host.Runtime == nil || !host.Runtime.AllowHostCommands {
		t.Fatalf("host command's allocation carries runtime %+v, want the trusted pool's", host.Runtime)
	}
	if img.NodeID != "a-images" || img.Runtime == nil || !img.Runtime.HostNetwork || img.Runtime.AllowHostCommands {
		t.Fatalf("image placed on %s with runtime %+v, want a-images with the images pool's policy", img.NodeID, img.Runtime)
	}
	if sim := job("sim", 1, ""); true {
		h.submit("acme", sim)
		h.cycle()
		if it := h.item("acme", "sim"); it.Runtime != nil {
			t.Fatalf("a simulated run's allocation carries a runtime: %+v", it.Runtime)
		}
	}

	// The trusted pool closes: a host command accepted before waits, and
	// says why.
	h2 := newHarness(t)
	h2.inventory("a-images", "images", "H100-80GB", 81920, 8)
	h2.poolConfig("trusted", &contracts.PoolRuntime{AllowHostCommands: true})
	h2.submit("acme", hostJob("host", ""))
	h2.poolConfig("trusted", &contracts.PoolRuntime{})
	h2.cycle()
	if ev := h2.last("acme", "host"); ev.Type != contracts.EventPending || ev.Reason != contracts.PendingNoSchedulableNode ||
		!strings.Contains(ev.Message, "runtime policy") {
		t.Fatalf("got %s %s %q, want pending no_schedulable_node naming the runtime policy", ev.Type, ev.Reason, ev.Message)
	}
}

// TestLocalityPrefersNodesWithTheImage: of two equal machines the one whose
// inventory lists the image (by reference in any spelling, or by digest)
// takes the job; a job of another image, or of none, goes to the first.
func TestLocalityPrefersNodesWithTheImage(t *testing.T) {
	digest := "sha256:" + strings.Repeat("ab", 32)
	tests := map[string]struct {
		image  string
		listed []string
		want   string
	}{
		"listed by its reference":    {"busybox", []string{"busybox"}, "n2"},
		"listed in the long form":    {"busybox", []string{"index.docker.io/library/busybox:latest"}, "n2"},
		"job in the long form":       {"docker.io/library/busybox:latest", []string{"busybox:latest"}, "n2"},
		"pinned by digest":           {"ghcr.io/acme/train@" + digest, []string{digest, "ghcr.io/acme/train:v3"}, "n2"},
		"another tag":                {"busybox:1.36", []string{"busybox"}, "n1"},
		"another image":              {"ghcr.io/acme/train:v3", []string{"busybox"}, "n1"},
		"no image":                   {"", []string{"busybox"}, "n1"},
		"listed garbage is no match": {"busybox", []string{"Not A Ref", ""}, "n1"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, func(c *Config) { c.Policy = contracts.PolicyBinpack })
			h.inventory("n1", "p", "H100-80GB", 81920, 8)
			inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "n2", Pool: "p", Incarnation: "i1", Time: h.now, Images: tt.listed}
			for i := range 8 {
				inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: "n2-gpu" + string(rune('0'+i)), Model: "H100-80GB",
					MemoryMiB: 81920, Healthy: true})
			}
			h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
			j := imageJob("j", "", tt.image)
			if tt.image == "" {
				j = job("j", 1, "")
			}
			h.submit("acme", j)
			h.cycle()
			if got := h.item("acme", "j").NodeID; got != tt.want {
				t.Fatalf("placed on %s, want %s", got, tt.want)
			}
		})
	}
	// A new inventory without the image ends the preference.
	h := newHarness(t, func(c *Config) { c.Policy = contracts.PolicyBinpack })
	h.inventory("n1", "p", "H100-80GB", 81920, 8)
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "n2", Pool: "p", Incarnation: "i1", Time: h.now, Images: []string{"busybox"},
		GPUs: []contracts.GPUInfo{{Index: 0, UUID: "n2-gpu0", Model: "H100-80GB", MemoryMiB: 81920, Healthy: true}}}
	h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
	inv.Images = nil
	h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
	if n := h.st.cluster.imageNodes["index.docker.io/library/busybox:latest"]; n != 0 {
		t.Fatalf("%d nodes counted as holding busybox after its only holder dropped it", n)
	}
}

// TestPullingBecomesJobEvents: the agent's pulling facts of a scheduled
// run are published as pulling job events with the progress, once each
// (a restart publishes the same IDs), and none after the run started.
func TestPullingBecomesJobEvents(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", "H100-80GB", 81920, 1)
	h.submit("acme", imageJob("j", "", "busybox"))
	h.cycle()
	a := h.item("acme", "j")
	h.commit(a)
	pull := func(done, total int64) {
		r := contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunPulling, AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID,
			Attempt: a.Attempt, NodeID: a.NodeID, Time: h.now, Pull: &contracts.PullProgress{Image: "busybox", Done: done, Total: total}}
		h.fact(func(s *Store) []Publish { return s.ApplyRun(r) })
	}
	pull(0, 0)
	pull(1<<20, 2<<20)
	h.restart() // mid-pull: the rebuild publishes nothing, and counts on
	pull(2<<20, 2<<20)
	h.started(a, h.now.Add(time.Second))
	pull(2<<20, 2<<20) // late: the run has started
	got := h.types("acme", "j")
	want := []string{"queued", "scheduled", "pulling", "pulling", "pulling", "running"}
	if !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}
	var msgs []string
	for _, p := range h.events {
		if p.ev.Type == contracts.EventPulling {
			if p.ev.Pull == nil || p.ev.State != contracts.StateScheduled {
				t.Fatalf("pulling event %+v: want the progress and state scheduled", p.ev)
			}
			msgs = append(msgs, p.ev.Message)
		}
	}
	if !strings.Contains(msgs[1], "1 of 2 MiB (50%)") {
		t.Fatalf("pulling message %q does not say the progress", msgs[1])
	}
	h.restart()
	h.noDuplicates()
}

// TestLaunchFailuresRetryOrFail: a run that could not start because its
// pull failed (or the machine has no runtime) is requeued up to
// MaxLaunchRetries times, counted across a restart, then fails with its
// reason; a missing image fails at once.
func TestLaunchFailuresRetryOrFail(t *testing.T) {
	tests := map[string]struct {
		reason  contracts.Reason
		retries int
	}{
		"pull failed":         {contracts.ReasonImagePullFailed, MaxLaunchRetries},
		"runtime unavailable": {contracts.ReasonRuntimeUnavailable, MaxLaunchRetries},
		"image not found":     {contracts.ReasonImageNotFound, 0},
		"unauthorized":        {contracts.ReasonImageUnauthorized, 0},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			h.inventory("n1", "p", "H100-80GB", 81920, 1)
			h.submit("acme", imageJob("j", "", "registry.example/acme/private:v1"))
			for attempt := 1; ; attempt++ {
				h.cycle()
				a := h.item("acme", "j")
				if a.Attempt != attempt {
					t.Fatalf("attempt %d placed, want %d", a.Attempt, attempt)
				}
				h.commit(a)
				h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: -1, EndedAt: h.now,
					Reason: tt.reason, Message: "registry says no"})
				h.release(a, contracts.ReasonRunEnded, nil)
				if attempt == 2 {
					h.restart() // the count of retries survives it
				}
				if ev := h.last("acme", "j"); ev.Type == contracts.EventFailed {
					if attempt != tt.retries+1 || ev.Reason != tt.reason || ev.Message != "registry says no" {
						t.Fatalf("failed at attempt %d with %s %q; want attempt %d with %s", attempt, ev.Reason, ev.Message, tt.retries+1, tt.reason)
					}
					break
				} else if ev.Type != contracts.EventRequeued || ev.Reason != tt.reason || !strings.Contains(ev.Message, "could not start on n1") {
					t.Fatalf("attempt %d: %s %s %q, want requeued with the reason", attempt, ev.Type, ev.Reason, ev.Message)
				}
				if attempt > MaxLaunchRetries+1 {
					t.Fatal("retried without end")
				}
			}
			h.noDuplicates()
		})
	}
}
