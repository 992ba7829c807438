// Package oci runs a run's container image with runc: it builds the OCI
// runtime spec of one run (config.json: the image's command overridden by
// the request's, its environment with the agent's, a non-root user,
// namespaces, seccomp, cgroup limits, mounts and exactly the run's GPUs,
// described as CDI), lays out its bundle (a per-run overlay on the image
// cache's shared read-only root) and drives runc (run, kill, state,
// delete). The runner's shim supervises `runc run` in the foreground as it
// does a host command, so output, exit codes, stops, checkpoints and
// re-adoption work the same for both.
package oci

import (
	"bufio"
	"errors"
	"fmt"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	cdispecs "tags.cncf.io/container-device-interface/specs-go"
)

// Image is what a run needs of its image: the unpacked root (shared by
// every run of the image, never written) and the image config's process
// fields. The image cache (internal/image) provides it.
type Image struct {
	Ref    string `json:"ref,omitempty"`
	Digest string `json:"digest,omitempty"`
	// RootFS is the unpacked image, read-only and shared.
	RootFS     string   `json:"rootfs"`
	Entrypoint []string `json:"entrypoint,omitempty"`
	Cmd        []string `json:"cmd,omitempty"`
	Env        []string `json:"env,omitempty"`
	User       string   `json:"user,omitempty"`
	WorkingDir string   `json:"workingDir,omitempty"`
	// Lease names the image cache's hold for the run, which a restarted
	// agent reclaims when it re-adopts the run.
	Lease string `json:"lease,omitempty"`
}

// Mount is a host path a container sees at Target.
type Mount struct {
	Source   string `json:"source"`
	Target   string `json:"target"`
	ReadOnly bool   `json:"readOnly,omitempty"`
}

// Config is one run's container, as the agent asks for it.
type Config struct {
	// ID is the container's runc ID (ContainerID), also its hostname and
	// its cgroup's name.
	ID    string
	Image Image
	// Command replaces the image's ENTRYPOINT and Args its CMD (either
	// alone keeps the other's image value, as Kubernetes reads them).
	Command, Args []string
	// Env is the request's environment with the agent's variables
	// (CUDA_VISIBLE_DEVICES, GPUPLANE_*), "KEY=value": it overrides the
	// image's variables of the same name.
	Env        []string
	WorkingDir string
	// User is "uid[:gid]" or "name[:group]" of the image; "" means the
	// image's user unless that is root, then NobodyID.
	User   string
	Mounts []Mount
	// CheckpointDir is the job's checkpoint directory on the host, "" for
	// none; RestoreFrom the checkpoint in it the run restores from. The
	// container sees it at ContainerCheckpointDir (CheckpointTarget), and
	// GPUPLANE_CHECKPOINT_DIR and GPUPLANE_RESTORE_FROM name it there.
	CheckpointDir, RestoreFrom string
	// ShmSizeMiB sizes /dev/shm; 0 means DefaultShmSizeMiB.
	ShmSizeMiB int64
	// CPUMilli and MemoryMiB are the cgroup limits; 0 means none.
	CPUMilli, MemoryMiB int64
	// HostNetwork keeps the container in the host's network namespace
	// (where the pool allows it); otherwise it has its own, loopback only.
	HostNetwork bool
	// CgroupParent is the cgroup under which each container gets its own:
	// "" means DefaultCgroupParent.
	CgroupParent string
	// GPUs are the CDI edits of the run's devices (EditsFor): device
	// nodes, driver libraries and binaries. Nil: no GPU at all.
	GPUs *cdispecs.ContainerEdits
}

const (
	// NobodyID is the user and group a container runs as when neither the
	// request nor the image names a non-root user.
	NobodyID = 65534
	// DefaultShmSizeMiB is Docker's default /dev/shm.
	DefaultShmSizeMiB = 64
	// DefaultCgroupParent holds every container's cgroup.
	DefaultCgroupParent = "gpuplane"
	// defaultPath is the PATH of an image that sets none.
	defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	// cpuPeriod is the CFS period the CPU quota is a share of (100 ms).
	cpuPeriod = 100000
	// pidsLimit bounds the processes of one container: a fork bomb of one
	// tenant must not exhaust the machine's pids.
	pidsLimit = 32768
)

// defaultCaps is Docker's default capability set: a container whose user
// is root gets these and no more; any other user none at all (only the
// bounding set, which setuid binaries cannot exceed under no_new_privs).
var defaultCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW", "CAP_SETGID",
	"CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

// maskedPaths and readonlyPaths are Docker's defaults: kernel interfaces a
// container has no business reading or writing.
var (
	maskedPaths = []string{
		"/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
		"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
		"/sys/devices/virtual/powercap",
	}
	readonlyPaths = []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
)

// The variables of the checkpoint protocol (runner.EnvCheckpointDir and
// runner.EnvRestoreFrom), which name paths inside the container here.
const (
	envCheckpointDir = "GPUPLANE_CHECKPOINT_DIR"
	envRestoreFrom   = "GPUPLANE_RESTORE_FROM"
)

// CheckpointTarget is where a container sees its job's checkpoint
// directory: /gpuplane/checkpoint, or under the tmpfs /tmp when the root
// is the read-only image (whose tree cannot take a new mount point).
func CheckpointTarget(readonlyRoot bool) string {
	if readonlyRoot {
		return "/tmp/gpuplane/checkpoint"
	}
	return "/gpuplane/checkpoint"
}

// ErrNoCommand is returned for a run whose image has no ENTRYPOINT or CMD
// and whose request names no command.
var ErrNoCommand = errors.New("no command: the image has no ENTRYPOINT or CMD and the run names none")

// Spec builds the OCI runtime spec of c, whose root is rootfs (a path
// relative to the bundle, or absolute) and read-only when readonlyRoot
// (then /tmp is a tmpfs). The image's /etc/passwd and /etc/group resolve
// user names.
func Spec(c Config, rootfs string, readonlyRoot bool) (*specs.Spec, error) {
	args := Argv(c.Image, c.Command, c.Args)
	if len(args) == 0 {
		return nil, ErrNoCommand
	}
	user, err := resolveUser(c.Image.RootFS, c.User, c.Image.User)
	if err != nil {
		return nil, err
	}
	cwd := cmpOr(c.WorkingDir, c.Image.WorkingDir, "/")
	if !path.IsAbs(cwd) {
		return nil, fmt.Errorf("working directory %q is not absolute", cwd)
	}
	caps := &specs.LinuxCapabilities{Bounding: slices.Clone(defaultCaps)}
	if user.UID == 0 {
		caps.Effective, caps.Permitted = slices.Clone(defaultCaps), slices.Clone(defaultCaps)
	}
	// As many open files as the agent may have: data loaders open many,
	// and more than the agent's own hard limit is refused.
	nofile := uint64(1 << 20)
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err == nil && rl.Max < nofile {
		nofile = rl.Max
	}
	shm := c.ShmSizeMiB
	if shm <= 0 {
		shm = DefaultShmSizeMiB
	}
	s := &specs.Spec{
		Version:  specs.Version,
		Root:     &specs.Root{Path: rootfs, Readonly: readonlyRoot},
		Hostname: hostname(c.ID),
		Process: &specs.Process{
			Args:            args,
			Env:             mergeEnv([]string{"HOME=" + home(c.Image.RootFS, user.UID)}, c.Image.Env, c.Env),
			Cwd:             cwd,
			User:            user,
			Capabilities:    caps,
			NoNewPrivileges: true,
			Rlimits:         []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: nofile, Soft: nofile}},
		},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=" + strconv.FormatInt(shm, 10) + "m"}},
			{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup", Options: []string{"nosuid", "noexec", "nodev", "relatime", "ro"}},
		},
		Linux: &specs.Linux{
			CgroupsPath: "/" + cmpOr(c.CgroupParent, DefaultCgroupParent) + "/" + c.ID,
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
			},
			Resources: &specs.LinuxResources{
				// Every device is denied but what runc always allows (null,
				// zero, full, tty, random, urandom, ptmx) and the GPUs'
				// nodes the CDI edits add.
				Devices: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}},
				Pids:    &specs.LinuxPids{Limit: ptr(int64(pidsLimit))},
			},
			MaskedPaths:   slices.Clone(maskedPaths),
			ReadonlyPaths: slices.Clone(readonlyPaths),
		},
	}
	if !c.HostNetwork {
		s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.NetworkNamespace})
	} else {
		// The host's names resolve as on the host.
		for _, f := range []string{"/etc/resolv.conf", "/etc/hosts"} {
			if _, err := os.Stat(f); err == nil {
				s.Mounts = append(s.Mounts, specs.Mount{Destination: f, Type: "bind", Source: f, Options: []string{"rbind", "ro", "nosuid", "nodev"}})
			}
		}
	}
	if readonlyRoot {
		s.Mounts = append(s.Mounts, specs.Mount{Destination: "/tmp", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev", "mode=1777"}})
	}
	if c.CheckpointDir != "" {
		target := CheckpointTarget(readonlyRoot)
		s.Mounts = append(s.Mounts, specs.Mount{Destination: target, Type: "bind", Source: c.CheckpointDir, Options: []string{"rbind", "nosuid", "nodev", "rw"}})
		env := []string{envCheckpointDir + "=" + target}
		if c.RestoreFrom != "" {
			env = append(env, envRestoreFrom+"="+path.Join(target, filepath.Base(c.RestoreFrom)))
		}
		s.Process.Env = mergeEnv(s.Process.Env, env)
	}
	for _, m := range c.Mounts {
		if !path.IsAbs(m.Source) || !path.IsAbs(m.Target) {
			return nil, fmt.Errorf("mount %s -> %s: both paths must be absolute", m.Source, m.Target)
		}
		opts := []string{"rbind", "nosuid", "nodev", "rw"}
		if m.ReadOnly {
			opts[3] = "ro"
		}
		s.Mounts = append(s.Mounts, specs.Mount{Destination: m.Target, Type: "bind", Source: m.Source, Options: opts})
	}
	if c.MemoryMiB > 0 {
		s.Linux.Resources.Memory = &specs.LinuxMemory{Limit: ptr(c.MemoryMiB << 20)}
	}
	if c.CPUMilli > 0 {
		s.Linux.Resources.CPU = &specs.LinuxCPU{Quota: ptr(c.CPUMilli * cpuPeriod / 1000), Period: ptr(uint64(cpuPeriod))}
	}
	if c.GPUs != nil {
		if err := applyEdits(s, c.GPUs); err != nil {
			return nil, fmt.Errorf("GPU devices: %w", err)
		}
	}
	// Last: the profile allows what the capabilities above need.
	sc, err := seccomp.GetDefaultProfile(s)
	if err != nil {
		return nil, fmt.Errorf("seccomp profile: %w", err)
	}
	s.Linux.Seccomp = sc
	return s, nil
}

// Argv is the container's command: Command, or the image's ENTRYPOINT,
// followed by Args, or the image's CMD when neither Command nor Args is
// set (Kubernetes' reading of command and args).
func Argv(img Image, command, args []string) []string {
	var out []string
	switch {
	case len(command) > 0:
		out = append(slices.Clone(command), args...)
	case len(args) > 0:
		out = append(slices.Clone(img.Entrypoint), args...)
	default:
		out = append(slices.Clone(img.Entrypoint), img.Cmd...)
	}
	return out
}

// mergeEnv is each list overridden by the next, key by key, sorted; PATH
// is set when none has one.
func mergeEnv(lists ...[]string) []string {
	m := map[string]string{}
	for _, list := range append([][]string{{defaultPath}}, lists...) {
		for _, kv := range list {
			k, v, _ := strings.Cut(kv, "=")
			if k != "" {
				m[k] = v
			}
		}
	}
	out := make([]string, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, k+"="+m[k])
	}
	return out
}

// resolveUser is the container's user: the request's, else the image's
// unless it is root (or unset), else nobody. Names are looked up in the
// image's /etc/passwd and /etc/group; a numeric user without a group gets
// its passwd group, or its own number as the group when passwd has none
// (never root's group by accident).
func resolveUser(rootfs, requested, image string) (specs.User, error) {
	spec := requested
	if spec == "" {
		spec = image
	}
	if spec == "" {
		return specs.User{UID: NobodyID, GID: NobodyID}, nil
	}
	u, g, _ := strings.Cut(spec, ":")
	uid, gid, err := lookupUser(rootfs, u)
	if err != nil {
		return specs.User{}, err
	}
	if g != "" {
		if gid, err = lookupGroup(rootfs, g); err != nil {
			return specs.User{}, err
		}
	}
	if uid == 0 && requested == "" {
		// The image runs as root: a tenant's job never does unless it
		// asks (and its pool lets it).
		return specs.User{UID: NobodyID, GID: NobodyID}, nil
	}
	return specs.User{UID: uid, GID: gid}, nil
}

// home is uid's home directory in the image's /etc/passwd, "/" when it
// has none (as Docker sets HOME); the image's or the request's HOME win.
func home(rootfs string, uid uint32) string {
	dir := "/"
	_ = scanDB(filepath.Join(rootfs, "etc/passwd"), func(f []string) bool {
		if len(f) >= 6 && f[2] == strconv.FormatUint(uint64(uid), 10) {
			if path.IsAbs(f[5]) {
				dir = f[5]
			}
			return true
		}
		return false
	})
	return dir
}

func lookupUser(rootfs, u string) (uid, gid uint32, err error) {
	if n, err := strconv.ParseUint(u, 10, 32); err == nil {
		uid, gid = uint32(n), uint32(n)
		_ = scanDB(filepath.Join(rootfs, "etc/passwd"), func(f []string) bool {
			if len(f) >= 4 && f[2] == u {
				if g, err := strconv.ParseUint(f[3], 10, 32); err == nil {
					gid = uint32(g)
				}
				return true
			}
			return false
		})
		return uid, gid, nil
	}
	found := false
	err = scanDB(filepath.Join(rootfs, "etc/passwd"), func(f []string) bool {
		if len(f) < 4 || f[0] != u {
			return false
		}
		a, err1 := strconv.ParseUint(f[2], 10, 32)
		b, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 == nil && err2 == nil {
			uid, gid, found = uint32(a), uint32(b), true
		}
		return true
	})
	if !found {
		return 0, 0, fmt.Errorf("user %q: not in the image's /etc/passwd (%v)", u, err)
	}
	return uid, gid, nil
}

func lookupGroup(rootfs, g string) (uint32, error) {
	if n, err := strconv.ParseUint(g, 10, 32); err == nil {
		return uint32(n), nil
	}
	var gid uint32
	found := false
	err := scanDB(filepath.Join(rootfs, "etc/group"), func(f []string) bool {
		if len(f) < 3 || f[0] != g {
			return false
		}
		if n, err := strconv.ParseUint(f[2], 10, 32); err == nil {
			gid, found = uint32(n), true
		}
		return true
	})
	if !found {
		return 0, fmt.Errorf("group %q: not in the image's /etc/group (%v)", g, err)
	}
	return gid, nil
}

// scanDB calls match with the ':'-separated fields of each line of a
// passwd-like file until it returns true. The file is read through the
// image root: a symbolic link in the image must not lead to the host's
// files, so one is refused.
func scanDB(file string, match func([]string) bool) error {
	if fi, err := os.Lstat(file); err != nil {
		return err
	} else if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", file)
	}
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if match(strings.Split(sc.Text(), ":")) {
			return nil
		}
	}
	return sc.Err()
}

func cmpOr(vs ...string) string {
	for _, v := range vs {
		if v != "" {
			return v
		}
	}
	return ""
}

// hostname is id cut to what sethostname takes.
func hostname(id string) string {
	if len(id) > 63 {
		return id[:63]
	}
	return id
}

func ptr[T any](v T) *T { return &v }
