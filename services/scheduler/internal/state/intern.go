package state

import (
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// names interns the texts that many jobs repeat: tenants, priorities,
// pools, GPU models and profiles, images. Each decoded request (and
// each tenant cut from a subject, which keeps the whole subject alive)
// is otherwise a copy of its own, held for as long as the job lives: at
// a million jobs, tens of megabytes of the same few words.
type names struct {
	m map[string]string
}

// maxNames bounds the table: past it, it starts afresh (the texts handed
// out stay valid, later ones are merely not shared with them). A fleet has
// tens of tenants, pools and models; images are the many.
const maxNames = 1 << 14

// of is s, interned. An empty s is returned as it is.
func (n *names) of(s string) string {
	if s == "" {
		return s
	}
	if v, ok := n.m[s]; ok {
		return v
	}
	if n.m == nil || len(n.m) >= maxNames {
		n.m = make(map[string]string, 64)
	}
	// A copy: s may be a piece of a larger text (a subject, a message).
	s = strings.Clone(s)
	n.m[s] = s
	return s
}

// request interns r's repeated texts in place. Values do not change, so
// neither does anything derived from them (the request's hash).
func (n *names) request(r *contracts.JobRequest) {
	r.Tenant = n.of(r.Tenant)
	r.Priority = contracts.Priority(n.of(string(r.Priority)))
	r.Pool = n.of(r.Pool)
	g := &r.Resources.GPU
	g.Model = n.of(g.Model)
	g.MIGProfile = n.of(g.MIGProfile)
	g.Topology = contracts.Topology(n.of(string(g.Topology)))
	for i, m := range g.Models {
		g.Models[i] = n.of(m)
	}
	r.Run.Image = n.of(r.Run.Image)
	r.Run.WorkingDir = n.of(r.Run.WorkingDir)
	r.Run.User = n.of(r.Run.User)
}
