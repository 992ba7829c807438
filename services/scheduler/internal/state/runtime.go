package state

import (
	"fmt"
	"slices"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"

	"github.com/gpuplane/gpuplane/contracts"
)

// Pools' runtime policies (contracts.PoolRuntime) and image locality.

// runtimeOf is pool's runtime policy as the scheduler applies it: its
// PoolConfig's, or the platform's default (host commands as
// Config.AllowHostCommands says, no mount roots, no host network).
func (s *Store) runtimeOf(pool string) *contracts.PoolRuntime {
	if c, ok := s.pools[pool]; ok && c.Runtime != nil {
		return c.Runtime
	}
	return &contracts.PoolRuntime{AllowHostCommands: s.cfg.AllowHostCommands}
}

// needsRuntime reports whether run depends on a pool's runtime policy: a
// host command or mounts. Images and simulated runs go anywhere.
func needsRuntime(run contracts.RunSpec) bool { return run.IsHostCommand() || len(run.Mounts) > 0 }

// checkRuntime rejects at submit a request no pool it may use would run:
// the pool it names refuses it (host_commands_not_allowed,
// mount_not_allowed), or it names none and neither a configured pool nor
// one without configuration would. As checkShareFits, it answers from
// what the scheduler knows now; a request accepted here waits (pending,
// no_schedulable_node) should an administrator later close the pools it
// could use.
func (s *Store) checkRuntime(req contracts.JobRequest) error {
	if !needsRuntime(req.Run) {
		return nil
	}
	reject := func(fe *contracts.FieldError, msg string) error {
		fe.Message = msg + ": " + fe.Message
		return &contracts.ValidationError{Reason: fe.Reason, Fields: []contracts.FieldError{*fe}}
	}
	if req.Pool != "" {
		if fe := contracts.CheckRuntime(s.runtimeOf(req.Pool), false, req.Run); fe != nil {
			return reject(fe, "pool "+req.Pool)
		}
		return nil
	}
	fe := contracts.CheckRuntime(s.runtimeOf(""), false, req.Run) // a pool without configuration
	if fe == nil {
		return nil
	}
	for pool := range s.pools {
		if contracts.CheckRuntime(s.runtimeOf(pool), false, req.Run) == nil {
			return nil
		}
	}
	return reject(fe, "no pool runs it")
}

// poolRuns is the placement request's PoolRuns for run: nil when any pool
// runs it.
func (s *Store) poolRuns(run contracts.RunSpec) func(string) bool {
	if !needsRuntime(run) {
		return nil
	}
	// A copy made here, not the parameter: captured, the parameter would
	// be moved to the heap on every call (a cycle calls this per job).
	spec := run
	return func(pool string) bool { return contracts.CheckRuntime(s.runtimeOf(pool), false, spec) == nil }
}

// imageKeys are the inventory entries that name the image of run: its
// reference in contracts.ImageRef's form and, when it is pinned by digest,
// the digest alone.
func imageKeys(run contracts.RunSpec) []string {
	ref := contracts.ImageRef(run)
	if ref == "" {
		return nil
	}
	keys := []string{ref}
	if _, digest, ok := strings.Cut(ref, "@"); ok {
		keys = append(keys, digest)
	}
	return keys
}

// inventoryImages normalizes a node's Images as imageKeys names them: a
// reference in ImageRef's form, a bare digest as it is.
func inventoryImages(images []string) map[string]bool {
	if len(images) == 0 {
		return nil
	}
	out := make(map[string]bool, len(images))
	for _, im := range images {
		if strings.HasPrefix(im, "sha256:") {
			out[im] = true
			continue
		}
		if r, err := name.ParseReference(im); err == nil {
			out[r.Name()] = true
		}
	}
	return out
}

// indexImages moves node n's images in the cluster's count of holders.
func (c *cluster) indexImages(n *nodeState, images map[string]bool) {
	for im := range n.images {
		if c.imageNodes[im]--; c.imageNodes[im] <= 0 {
			delete(c.imageNodes, im)
		}
	}
	n.images = images
	for im := range images {
		c.imageNodes[im]++
	}
}

// prefer is the placement request's Prefer for run: the nodes whose
// inventory lists its image; nil when it has none or no node holds it.
func (s *Store) prefer(run contracts.RunSpec) func(string) bool {
	if run.Image == "" || len(s.cluster.imageNodes) == 0 {
		return nil // no image, or no node lists one: nothing to prefer
	}
	found := slices.DeleteFunc(imageKeys(run), func(k string) bool { return s.cluster.imageNodes[k] == 0 })
	if len(found) == 0 {
		return nil
	}
	keys := found // captured: declared only when a closure is made
	return func(node string) bool {
		n := s.cluster.nodes[node]
		if n == nil {
			return false
		}
		for _, k := range keys {
			if n.images[k] {
				return true
			}
		}
		return false
	}
}

// pullingEvent publishes the progress of the pull of j's image as a job
// event (pulling), while the job is scheduled: each pulling fact of the
// attempt is one event, seq counting them. A rebuild counts the facts it
// replays without publishing (their events are in JOB_EVENTS already), so
// the next fact gets the next ID.
func (s *Store) pullingEvent(j *Job, p *part, r contracts.RunEvent) {
	if r.Pull == nil || p.started != nil || j.State != contracts.StateScheduled {
		return
	}
	p.pulls++
	if !s.live {
		return
	}
	pull := *r.Pull
	s.emit(j, contracts.EventPulling, p.pulls, func(ev *contracts.JobEvent) {
		ev.Pull = &pull
		ev.Message = pullMessage(r.NodeID, pull)
	})
}

func pullMessage(node string, p contracts.PullProgress) string {
	if p.Total <= 0 {
		return fmt.Sprintf("pulling %s on %s", p.Image, node)
	}
	return fmt.Sprintf("pulling %s on %s: %d of %d MiB (%d%%)", p.Image, node, p.Done>>20, p.Total>>20, p.Done*100/p.Total)
}

// MaxLaunchRetries is how many times a job whose run could not start for a
// reason that may pass (retriesLaunch) is requeued before it fails with
// that reason.
const MaxLaunchRetries = 3

// retriesLaunch reports whether a run that never started for reason r may
// start in another attempt: a pull that failed on the network or the
// registry's side, a machine without a working runtime, an MPS daemon not
// up. A missing image, a refused login or an invalid reference fail the
// job at once: another attempt would meet them again.
func retriesLaunch(r contracts.Reason) bool {
	switch r {
	case contracts.ReasonImagePullFailed, contracts.ReasonRuntimeUnavailable, contracts.ReasonMPSUnavailable:
		return true
	}
	return false
}
