package oci

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestArgv(t *testing.T) {
	img := Image{Entrypoint: []string{"/entry", "-v"}, Cmd: []string{"serve", "--port=80"}}
	tests := map[string]struct {
		img           Image
		command, args []string
		want          []string
	}{
		"image as is":             {img: img, want: []string{"/entry", "-v", "serve", "--port=80"}},
		"args replace CMD":        {img: img, args: []string{"train"}, want: []string{"/entry", "-v", "train"}},
		"command replaces both":   {img: img, command: []string{"/bin/sh"}, want: []string{"/bin/sh"}},
		"command and args":        {img: img, command: []string{"/bin/sh", "-c"}, args: []string{"echo hi"}, want: []string{"/bin/sh", "-c", "echo hi"}},
		"CMD alone":               {img: Image{Cmd: []string{"/bin/sh"}}, want: []string{"/bin/sh"}},
		"args without entrypoint": {img: Image{Cmd: []string{"/bin/sh"}}, args: []string{"/bin/true"}, want: []string{"/bin/true"}},
		"nothing":                 {img: Image{}, want: nil},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, Argv(tt.img, tt.command, tt.args)); diff != "" {
				t.Errorf("Argv (-want +got):\n%s", diff)
			}
		})
	}
}

// testRoot is an image root with the passwd and group files user names
// resolve from.
func testRoot(t *testing.T) string {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{
		"etc/passwd": "root:x:0:0::/root:/bin/sh\napp:x:1000:1001::/home/app:/bin/sh\n",
		"etc/group":  "root:x:0:\napp:x:1001:\nvideo:x:44:app\n",
	} {
		if err := os.WriteFile(filepath.Join(root, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestResolveUser(t *testing.T) {
	root := testRoot(t)
	tests := map[string]struct {
		requested, image string
		want             specs.User
		wantErr          bool
	}{
		"neither: nobody":             {want: specs.User{UID: NobodyID, GID: NobodyID}},
		"image root: nobody":          {image: "root", want: specs.User{UID: NobodyID, GID: NobodyID}},
		"image uid 0: nobody":         {image: "0:0", want: specs.User{UID: NobodyID, GID: NobodyID}},
		"image's named user":          {image: "app", want: specs.User{UID: 1000, GID: 1001}},
		"image's numeric user":        {image: "1000", want: specs.User{UID: 1000, GID: 1001}},
		"unknown uid: its own group":  {image: "4242", want: specs.User{UID: 4242, GID: 4242}},
		"request over image":          {requested: "4242:44", image: "app", want: specs.User{UID: 4242, GID: 44}},
		"request names user, group":   {requested: "app:video", want: specs.User{UID: 1000, GID: 44}},
		"request for root is granted": {requested: "0", image: "app", want: specs.User{UID: 0, GID: 0}},
		"unknown name":                {requested: "ghost", wantErr: true},
		"unknown group":               {requested: "app:ghosts", wantErr: true},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			got, err := resolveUser(root, tt.requested, tt.image)
			if (err != nil) != tt.wantErr {
				t.Fatalf("resolveUser(%q, %q) error %v, want error %v", tt.requested, tt.image, err, tt.wantErr)
			}
			if diff := cmp.Diff(tt.want, got); !tt.wantErr && diff != "" {
				t.Errorf("user (-want +got):\n%s", diff)
			}
		})
	}
}

func TestSpec(t *testing.T) {
	root := testRoot(t)
	base := Config{
		ID:    "gp-acme_job-1_1-abcd",
		Image: Image{RootFS: root, Cmd: []string{"/bin/sh"}, Env: []string{"PATH=/opt/bin", "LANG=C", "CUDA_VISIBLE_DEVICES=all"}, User: "root", WorkingDir: "/work"},
		Env:   []string{"LANG=en_US.UTF-8", "CUDA_VISIBLE_DEVICES=GPU-1", "GPUPLANE_JOB_ID=job-1"},
		Mounts: []Mount{
			{Source: "/datasets/imagenet", Target: "/data", ReadOnly: true},
			{Source: "/scratch/acme", Target: "/scratch"},
		},
		ShmSizeMiB: 2048, CPUMilli: 4500, MemoryMiB: 16384,
	}
	s, err := Spec(base, "rootfs", false)
	if err != nil {
		t.Fatal(err)
	}
	p := s.Process
	if diff := cmp.Diff([]string{"CUDA_VISIBLE_DEVICES=GPU-1", "GPUPLANE_JOB_ID=job-1", "HOME=/", "LANG=en_US.UTF-8", "PATH=/opt/bin"}, p.Env); diff != "" {
		t.Errorf("env: the request's and the agent's over the image's (-want +got):\n%s", diff)
	}
	if p.User.UID != NobodyID || p.User.GID != NobodyID || !p.NoNewPrivileges || p.Cwd != "/work" {
		t.Errorf("process user %+v, noNewPrivileges %v, cwd %q; want nobody, true, /work", p.User, p.NoNewPrivileges, p.Cwd)
	}
	if len(p.Capabilities.Effective) != 0 || len(p.Capabilities.Permitted) != 0 {
		t.Errorf("a non-root process has capabilities %v", p.Capabilities.Effective)
	}
	var ns []specs.LinuxNamespaceType
	for _, n := range s.Linux.Namespaces {
		ns = append(ns, n.Type)
	}
	slices.Sort(ns)
	if diff := cmp.Diff([]specs.LinuxNamespaceType{"ipc", "mount", "network", "pid", "uts"}, ns); diff != "" {
		t.Errorf("namespaces (-want +got):\n%s", diff)
	}
	if got := *s.Linux.Resources.Memory.Limit; got != 16384<<20 {
		t.Errorf("memory limit %d, want %d", got, 16384<<20)
	}
	if q, per := *s.Linux.Resources.CPU.Quota, *s.Linux.Resources.CPU.Period; q != 450000 || per != 100000 {
		t.Errorf("cpu quota %d/%d, want 450000/100000 (4.5 CPUs)", q, per)
	}
	if s.Linux.CgroupsPath != "/gpuplane/gp-acme_job-1_1-abcd" {
		t.Errorf("cgroupsPath %q", s.Linux.CgroupsPath)
	}
	if s.Linux.Seccomp == nil || s.Linux.Seccomp.DefaultAction != specs.ActErrno || len(s.Linux.Seccomp.Syscalls) == 0 {
		t.Errorf("seccomp is not Docker's default profile: %+v", s.Linux.Seccomp)
	}
	if !slices.Contains(s.Linux.MaskedPaths, "/proc/kcore") || !slices.Contains(s.Linux.ReadonlyPaths, "/proc/sys") {
		t.Errorf("masked %v, read-only %v: want Docker's defaults", s.Linux.MaskedPaths, s.Linux.ReadonlyPaths)
	}
	mounts := map[string]specs.Mount{}
	for _, m := range s.Mounts {
		mounts[m.Destination] = m
	}
	if m := mounts["/data"]; m.Source != "/datasets/imagenet" || !slices.Contains(m.Options, "ro") {
		t.Errorf("/data mount %+v, want a read-only bind of /datasets/imagenet", m)
	}
	if m := mounts["/scratch"]; !slices.Contains(m.Options, "rw") {
		t.Errorf("/scratch mount %+v, want read-write", m)
	}
	if m := mounts["/dev/shm"]; !slices.Contains(m.Options, "size=2048m") {
		t.Errorf("/dev/shm options %v, want size=2048m", m.Options)
	}
	if _, ok := mounts["/tmp"]; ok {
		t.Error("a writable root got a tmpfs /tmp")
	}

	t.Run("host network", func(t *testing.T) {
		c := base
		c.HostNetwork = true
		s, err := Spec(c, "rootfs", true)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range s.Linux.Namespaces {
			if n.Type == specs.NetworkNamespace {
				t.Error("host network, yet a network namespace")
			}
		}
		if !s.Root.Readonly || !slices.ContainsFunc(s.Mounts, func(m specs.Mount) bool { return m.Destination == "/tmp" && m.Type == "tmpfs" }) {
			t.Error("read-only root without a tmpfs /tmp")
		}
	})
	t.Run("checkpoint directory", func(t *testing.T) {
		for _, readonly := range []bool{false, true} {
			c := base
			c.CheckpointDir, c.RestoreFrom = "/var/lib/gpuplane/ckpt/acme/job-1", "/var/lib/gpuplane/ckpt/acme/job-1/ckpt-3"
			c.Env = append(c.Env, "GPUPLANE_CHECKPOINT_DIR=/host/path") // the host's path means nothing inside
			s, err := Spec(c, "rootfs", readonly)
			if err != nil {
				t.Fatal(err)
			}
			target := CheckpointTarget(readonly)
			env := map[string]string{}
			for _, kv := range s.Process.Env {
				k, v, _ := strings.Cut(kv, "=")
				env[k] = v
			}
			if env["GPUPLANE_CHECKPOINT_DIR"] != target || env["GPUPLANE_RESTORE_FROM"] != target+"/ckpt-3" {
				t.Errorf("read-only root %v: env %v, want the checkpoint at %s", readonly, env, target)
			}
			i := slices.IndexFunc(s.Mounts, func(m specs.Mount) bool { return m.Destination == target })
			if i < 0 || s.Mounts[i].Source != c.CheckpointDir || !slices.Contains(s.Mounts[i].Options, "rw") {
				t.Fatalf("read-only root %v: no writable mount of the checkpoint directory at %s: %+v", readonly, target, s.Mounts)
			}
			// A read-only root takes new mount points only in its tmpfs /tmp,
			// mounted before.
			if tmp := slices.IndexFunc(s.Mounts, func(m specs.Mount) bool { return m.Destination == "/tmp" }); readonly && (tmp < 0 || tmp > i) {
				t.Errorf("the checkpoint mount (%d) is not under the tmpfs /tmp mounted before it (%d)", i, tmp)
			}
		}
	})
	t.Run("home of the user", func(t *testing.T) {
		c := base
		c.User = "app"
		s, err := Spec(c, "rootfs", false)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(s.Process.Env, "HOME=/home/app") {
			t.Errorf("env %v, want app's HOME from the image's passwd", s.Process.Env)
		}
		c.Env = append(c.Env, "HOME=/work")
		if s, _ := Spec(c, "rootfs", false); !slices.Contains(s.Process.Env, "HOME=/work") {
			t.Errorf("env %v, want the request's HOME", s.Process.Env)
		}
	})
	t.Run("root asked", func(t *testing.T) {
		c := base
		c.User = "0"
		s, err := Spec(c, "rootfs", false)
		if err != nil {
			t.Fatal(err)
		}
		if s.Process.User.UID != 0 || len(s.Process.Capabilities.Effective) != len(defaultCaps) {
			t.Errorf("user %+v caps %v: want root with Docker's default capabilities only", s.Process.User, s.Process.Capabilities.Effective)
		}
	})
	t.Run("no command", func(t *testing.T) {
		c := base
		c.Image.Cmd = nil
		if _, err := Spec(c, "rootfs", false); err != ErrNoCommand {
			t.Errorf("error %v, want ErrNoCommand", err)
		}
	})
}

func TestContainerID(t *testing.T) {
	ids := map[string]bool{}
	for _, alloc := range []string{"acme/job-1/1", "acme/job-1/1#0", "acme/job-1/1#1", "acme_job-1/1", "acme/a.b+c/2"} {
		id := ContainerID(alloc)
		if containerIDRE.MatchString(id) || len(id) > 80 {
			t.Errorf("ContainerID(%q) = %q: not a runc ID", alloc, id)
		}
		if ids[id] {
			t.Errorf("ContainerID(%q) = %q twice", alloc, id)
		}
		ids[id] = true
	}
}
