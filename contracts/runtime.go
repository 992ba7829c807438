package contracts

import (
	"fmt"
	"log/slog"
	"maps"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
)

// Jobs as container images (issue 14). A run names an OCI image (run.image)
// and the node agent runs it with runc: Command replaces the image's
// ENTRYPOINT and Args its CMD, as Kubernetes reads command and args. A run
// without an image is a host command (Command with Args appended), which
// only pools whose PoolRuntime allows host commands take: by default a pool
// runs images only, since a host command runs as the agent's user with
// nothing but CUDA_VISIBLE_DEVICES between tenants.

// Container reasons: rejected requests, refused placements and failed
// attempts of container runs.
const (
	// ReasonImageInvalid: run.image is not an OCI reference (name, tag or
	// digest) that go-containerregistry's name.ParseReference accepts.
	ReasonImageInvalid Reason = "image_invalid"
	// ReasonMountNotAllowed: a mount's source is outside the roots its
	// pool allows (PoolRuntime.MountRoots), or the mount would cover or
	// expose what a container must not (/proc, /sys, /dev).
	ReasonMountNotAllowed Reason = "mount_not_allowed"
	// ReasonHostCommandsNotAllowed: a run without an image (a host
	// command) asked of a pool that runs images only.
	ReasonHostCommandsNotAllowed Reason = "host_commands_not_allowed"
	// ReasonImageNotFound: the registry has no such repository, tag or
	// digest (the attempt fails; the message is the registry's).
	ReasonImageNotFound Reason = "image_not_found"
	// ReasonImageUnauthorized: the registry refused the tenant's
	// credentials, or asked for credentials the tenant has not stored.
	ReasonImageUnauthorized Reason = "image_unauthorized"
	// ReasonImagePullFailed: any other failure to pull or unpack the image
	// (network, registry error, disk), with the registry's message.
	ReasonImagePullFailed Reason = "image_pull_failed"
	// ReasonRuntimeUnavailable: the node has no working container runtime
	// (runc missing or failing), so it cannot run an image; host commands
	// still run where the pool allows them.
	ReasonRuntimeUnavailable Reason = "runtime_unavailable"
	// ReasonMPSUnavailable: a share was to be launched on a GPU whose MPS
	// control daemon is not up, so its limits could not be enforced.
	ReasonMPSUnavailable Reason = "mps_unavailable"
)

// Limits of a container run.
const (
	MaxImageRefBytes = 1024
	MaxMounts        = 32
	MaxPathBytes     = 4096
	// MaxShmSizeMiB bounds /dev/shm (default DefaultShmSizeMiB): it is
	// memory of the container, counted against its memory limit.
	MaxShmSizeMiB     = 1 << 20
	DefaultShmSizeMiB = 64
	MaxMountRoots     = 32
)

// Mount is a host path the run sees at Target. Source must lie under one
// of the pool's PoolRuntime.MountRoots; ReadOnly mounts datasets, a
// read-write one is scratch that outlives the run.
type Mount struct {
	Source   string `json:"source" jsonschema:"description=absolute host path under one of the pool's mount roots"`
	Target   string `json:"target" jsonschema:"description=absolute path inside the container"`
	ReadOnly bool   `json:"readOnly,omitempty"`
}

// PoolRuntime is a pool's policy for what runs on its machines, part of
// its PoolConfig. A pool without one takes the platform's default: images
// only (the scheduler's -allow-host-commands says otherwise, as `make
// run`'s all-in-one does), no mounts, no host network.
type PoolRuntime struct {
	// AllowHostCommands lets runs without an image (host commands) into
	// the pool: for trusted pools only.
	AllowHostCommands bool `json:"allowHostCommands,omitempty"`
	// MountRoots are the host directories (and everything under them)
	// that a run's mounts may name as their source.
	MountRoots []string `json:"mountRoots,omitempty"`
	// HostNetwork runs containers in the host's network namespace (gangs
	// need it for NCCL over the machines' own interfaces); otherwise a
	// container has its own, with loopback only.
	HostNetwork bool `json:"hostNetwork,omitempty"`
}

// cleanPathPattern is an absolute path with at least one element, in the
// form path.Clean leaves it: no empty, "." or ".." element, no trailing
// slash, no NUL. The schema states it, and Validate checks it with the same
// expression.
const cleanPathPattern = `^(/([^/.\x00][^/\x00]*|\.[^/.\x00][^/\x00]*|\.\.[^/\x00]+))+$`

// userPattern is run.user: a user and an optional group, each a number or
// a name the image's /etc/passwd (or /etc/group) defines.
const userPattern = `^([0-9]{1,9}|[a-z_][a-z0-9_.-]{0,31})(:([0-9]{1,9}|[a-z_][a-z0-9_.-]{0,31}))?$`

var (
	userRE = regexp.MustCompile(userPattern)
)

// hiddenPaths are the host and container trees no mount may name: a host
// source under them would hand the container the host's processes,
// kernel settings or devices; a target under them would cover what the
// runtime mounts there (and the device cgroup's allow-list).
var hiddenPaths = []string{"/proc", "/sys", "/dev"}

// under reports whether p is root or lies below it (both clean).
func under(p, root string) bool {
	return p == root || root == "/" || strings.HasPrefix(p, root+"/")
}

// IsContainer reports whether r runs an image (rather than a host command
// or a simulated run).
func (r RunSpec) IsContainer() bool { return r.Image != "" }

// IsHostCommand reports whether r is a command run on the host: a command
// without an image.
func (r RunSpec) IsHostCommand() bool { return r.Image == "" && len(r.Command) > 0 }

// Argv is what a host command runs: Command with Args appended. A
// container's argv is the agent's to build from the image's ENTRYPOINT and
// CMD.
func (r RunSpec) Argv() []string {
	if len(r.Args) == 0 {
		return r.Command
	}
	return append(slices.Clip(r.Command), r.Args...)
}

// ParseImage parses an image reference as the node agent pulls it: a
// name with a tag (":latest" when none) or a digest; a name without a
// registry is Docker Hub's.
func ParseImage(ref string) (name.Reference, error) {
	if len(ref) > MaxImageRefBytes {
		return nil, fmt.Errorf("image reference is %d bytes, limit is %d", len(ref), MaxImageRefBytes)
	}
	if strings.TrimSpace(ref) != ref {
		return nil, fmt.Errorf("image reference %q has surrounding spaces", ref)
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		return nil, fmt.Errorf("image reference %q: %w", ref, err)
	}
	return r, nil
}

// validateContainer adds the field errors of r's container fields, those
// it can judge without the pool's policy (the scheduler holds mounts to the
// pool's roots: CheckRuntime).
func (r *RunSpec) validateContainer(memoryMiB int64, add func(field string, reason Reason, format string, args ...any)) {
	if r.Image != "" {
		if _, err := ParseImage(r.Image); err != nil {
			add("run.image", ReasonImageInvalid, "%v", err)
		}
		if r.ExitCode != 0 {
			add("run.exitCode", ReasonConflictingRun, "exitCode is the end of a simulated run; a container's is its process's")
		}
	} else {
		// What only a container can have.
		for _, f := range []struct {
			field string
			set   bool
		}{
			{"run.workingDir", r.WorkingDir != ""}, {"run.mounts", len(r.Mounts) > 0},
			{"run.shmSizeMiB", r.ShmSizeMiB != 0}, {"run.user", r.User != ""},
		} {
			if f.set {
				add(f.field, ReasonConflictingRun, "%s applies to a container: set run.image", strings.TrimPrefix(f.field, "run."))
			}
		}
		if len(r.Args) > 0 && len(r.Command) == 0 {
			add("run.args", ReasonConflictingRun, "args are appended to run.command, or replace an image's CMD: set one of them")
		}
	}
	if r.WorkingDir != "" && r.WorkingDir != "/" && !isCleanPath(r.WorkingDir) {
		add("run.workingDir", ReasonInvalidValue, "working directory %q is not a clean absolute path", r.WorkingDir)
	}
	if len(r.WorkingDir) > MaxPathBytes {
		add("run.workingDir", ReasonOutOfRange, "working directory is %d bytes, limit is %d", len(r.WorkingDir), MaxPathBytes)
	}
	if r.User != "" && !userRE.MatchString(r.User) {
		add("run.user", ReasonInvalidValue, "user %q is not uid[:gid] or a name[:group] of the image", r.User)
	}
	switch {
	case r.ShmSizeMiB < 0 || r.ShmSizeMiB > MaxShmSizeMiB:
		add("run.shmSizeMiB", ReasonOutOfRange, "shm size %d MiB; want 0 (default %d) to %d", r.ShmSizeMiB, DefaultShmSizeMiB, MaxShmSizeMiB)
	case memoryMiB > 0 && r.ShmSizeMiB > memoryMiB:
		add("run.shmSizeMiB", ReasonOutOfRange, "shm size %d MiB is more than the run's memory limit, %d MiB: /dev/shm is memory of the container",
			r.ShmSizeMiB, memoryMiB)
	}
	if len(r.Mounts) > MaxMounts {
		add("run.mounts", ReasonOutOfRange, "%d mounts, limit is %d", len(r.Mounts), MaxMounts)
		return
	}
	targets := map[string]int{}
	for i, m := range r.Mounts {
		field := fmt.Sprintf("run.mounts[%d]", i)
		switch {
		case len(m.Source) > MaxPathBytes:
			add(field+".source", ReasonOutOfRange, "source is %d bytes, limit is %d", len(m.Source), MaxPathBytes)
		case !isCleanPath(m.Source):
			add(field+".source", ReasonInvalidValue, "source %q is not a clean absolute host path (no '..', '.', '//' or trailing '/')", m.Source)
		case slices.ContainsFunc(hiddenPaths, func(h string) bool { return under(m.Source, h) }):
			add(field+".source", ReasonMountNotAllowed, "source %q would give the container the host's %s", m.Source, topDir(m.Source))
		}
		switch {
		case len(m.Target) > MaxPathBytes:
			add(field+".target", ReasonOutOfRange, "target is %d bytes, limit is %d", len(m.Target), MaxPathBytes)
		case !isCleanPath(m.Target):
			add(field+".target", ReasonInvalidValue, "target %q is not a clean absolute path other than /", m.Target)
		case slices.ContainsFunc(hiddenPaths, func(h string) bool { return under(m.Target, h) }):
			add(field+".target", ReasonMountNotAllowed, "target %q is under %s, which the runtime provides", m.Target, topDir(m.Target))
		default:
			if j, dup := targets[m.Target]; dup {
				add(field+".target", ReasonInvalidValue, "target %q is also mounts[%d]'s", m.Target, j)
			}
			targets[m.Target] = i
		}
	}
}

func topDir(p string) string {
	if i := strings.IndexByte(p[1:], '/'); i >= 0 {
		return p[:i+1]
	}
	return p
}

// HostCommandsAllowed is the pool's policy on host commands, with
// platformDefault for a pool that states none.
func (p *PoolRuntime) HostCommandsAllowed(platformDefault bool) bool {
	if p == nil {
		return platformDefault
	}
	return p.AllowHostCommands
}

// MountAllowed reports whether source lies under one of the pool's mount
// roots. The agent resolves symbolic links before it mounts and asks again
// of the resolved path, so a link under a root cannot lead out of it.
func (p *PoolRuntime) MountAllowed(source string) bool {
	if p == nil || !isCleanPath(source) {
		return false
	}
	return slices.ContainsFunc(p.MountRoots, func(root string) bool { return under(source, root) })
}

// CheckRuntime says whether a pool of policy p (platformDefault for host
// commands when p is nil) may run run: nil, or the field error of the
// first rule it breaks (host_commands_not_allowed, mount_not_allowed). The
// scheduler rejects or keeps a job off a pool with it, and the node agent
// refuses a launch with it, so the two agree.
func CheckRuntime(p *PoolRuntime, platformDefault bool, run RunSpec) *FieldError {
	if run.IsHostCommand() && !p.HostCommandsAllowed(platformDefault) {
		return &FieldError{Field: "run.image", Reason: ReasonHostCommandsNotAllowed,
			Message: "this pool runs container images only: set run.image (the command then runs in the image)"}
	}
	for i, m := range run.Mounts {
		if !p.MountAllowed(m.Source) {
			roots := "none"
			if p != nil && len(p.MountRoots) > 0 {
				roots = strings.Join(p.MountRoots, ", ")
			}
			return &FieldError{Field: fmt.Sprintf("run.mounts[%d].source", i), Reason: ReasonMountNotAllowed,
				Message: fmt.Sprintf("source %q is outside the pool's mount roots (%s)", m.Source, roots)}
		}
	}
	return nil
}

// validate adds the field errors of a pool's runtime policy.
func (p *PoolRuntime) validate(add func(field string, reason Reason, format string, args ...any)) {
	if p == nil {
		return
	}
	if len(p.MountRoots) > MaxMountRoots {
		add("runtime.mountRoots", ReasonOutOfRange, "%d mount roots, limit is %d", len(p.MountRoots), MaxMountRoots)
	}
	for i, root := range p.MountRoots {
		field := fmt.Sprintf("runtime.mountRoots[%d]", i)
		switch {
		case len(root) > MaxPathBytes || !isCleanPath(root):
			add(field, ReasonInvalidValue, "mount root %q is not a clean absolute path other than /", root)
		case slices.ContainsFunc(hiddenPaths, func(h string) bool { return under(root, h) || under(h, root) }):
			add(field, ReasonMountNotAllowed, "mount root %q would let runs mount the host's /proc, /sys or /dev", root)
		}
	}
}

// Registry credentials: one RegistryCredentials per tenant in
// BucketRegistryCredentials, the key is the tenant. Node agents read them
// to pull a tenant's private images; only platform administrators write
// them (on the bus, as BusAdmin). Nothing else may read them, and no one
// logs them: RegistryAuth prints as redacted.
const BucketRegistryCredentials = "gp-registry-credentials"

// RegistryCredentials are one tenant's logins to image registries.
type RegistryCredentials struct {
	SchemaVersion int    `json:"schemaVersion,omitempty"`
	Tenant        string `json:"tenant"`
	// Registries maps a registry host ("ghcr.io", "registry.example:5000";
	// "index.docker.io" for Docker Hub) to the login there.
	Registries map[string]RegistryAuth `json:"registries"`
	UpdatedAt  time.Time               `json:"updatedAt,omitzero"`
}

// RegistryAuth is a login to one registry: a user name with a password
// (or a personal access token used as one), or a bearer token alone.
type RegistryAuth struct {
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
	Token    string `json:"token,omitempty"`
}

const redacted = "[redacted]"

// String never shows the secret, so a login printed by mistake (%v, %+v)
// leaks nothing.
func (a RegistryAuth) String() string {
	if a.Username == "" {
		return "RegistryAuth{token " + redacted + "}"
	}
	return "RegistryAuth{" + a.Username + " " + redacted + "}"
}

// GoString is String for %#v.
func (a RegistryAuth) GoString() string { return a.String() }

// LogValue keeps the secret out of structured logs.
func (a RegistryAuth) LogValue() slog.Value {
	return slog.GroupValue(slog.String("username", a.Username), slog.String("secret", redacted))
}

// For returns the login for the registry of image ref, if the tenant
// stored one.
func (c RegistryCredentials) For(ref name.Reference) (RegistryAuth, bool) {
	a, ok := c.Registries[ref.Context().RegistryStr()]
	return a, ok
}

// Validate checks the credentials stored for tenant.
func (c RegistryCredentials) Validate(tenant string) error {
	var errs []FieldError
	add := func(field string, reason Reason, format string, args ...any) {
		errs = append(errs, FieldError{Field: field, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	if err := ValidateTenant(tenant); err != nil {
		add("tenant", ReasonInvalidTenant, "%v", err)
	} else if c.Tenant != "" && c.Tenant != tenant {
		add("tenant", ReasonTenantMismatch, "credentials name tenant %q but are stored for %q", c.Tenant, tenant)
	}
	for _, host := range slices.Sorted(maps.Keys(c.Registries)) {
		a := c.Registries[host]
		field := "registries." + host
		if _, err := name.NewRegistry(host, name.StrictValidation); err != nil || strings.ContainsAny(host, "/ ") {
			add(field, ReasonInvalidValue, "%q is not a registry host[:port]", host)
		}
		switch {
		case a.Token != "" && (a.Username != "" || a.Password != ""):
			add(field, ReasonInvalidValue, "a login is a username with a password, or a token alone")
		case a.Token == "" && (a.Username == "" || a.Password == ""):
			add(field, ReasonMissingField, "a login needs a username and a password, or a token")
		}
	}
	return newValidationError(errs)
}

// PullProgress is how far a pull of a run's image has come (RunPulling).
// Total is 0 until the manifest is read.
type PullProgress struct {
	Image string `json:"image"`
	// Digest is the manifest's digest, once resolved.
	Digest string `json:"digest,omitempty"`
	Done   int64  `json:"done"`
	Total  int64  `json:"total"`
}

// RunPullingID is the Nats-Msg-Id of a pulling fact; seq tells the
// reports of one pull apart (the agent reports a few, not every byte).
func RunPullingID(allocationID string, seq int) string {
	return fmt.Sprintf("run/pulling/%s/%d", allocationID, seq)
}

// ImageRef returns the image's reference as the agent's cache and the
// inventory name it (name.Reference's Name: registry/repository:tag or
// @digest, with Docker Hub's defaults filled in), or "" when run has no
// image or it does not parse.
func ImageRef(run RunSpec) string {
	if run.Image == "" {
		return ""
	}
	r, err := ParseImage(run.Image)
	if err != nil {
		return ""
	}
	return r.Name()
}
