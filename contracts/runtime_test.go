package contracts

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"path"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
)

func TestCheckRuntime(t *testing.T) {
	image := RunSpec{Image: "busybox", Command: []string{"true"}}
	host := RunSpec{Command: []string{"true"}}
	sim := RunSpec{Duration: Duration(1)}
	mounted := func(src string) RunSpec {
		r := image
		r.Mounts = []Mount{{Source: "/data/a", Target: "/a"}, {Source: src, Target: "/b"}}
		return r
	}
	roots := &PoolRuntime{MountRoots: []string{"/data", "/scratch/jobs"}}
	tests := map[string]struct {
		pool    *PoolRuntime
		dflt    bool
		run     RunSpec
		reason  Reason
		field   string
		message string
	}{
		"image, no policy":             {nil, false, image, "", "", ""},
		"simulated, no policy":         {nil, false, sim, "", "", ""},
		"host, no policy":              {nil, false, host, ReasonHostCommandsNotAllowed, "run.image", "images only"},
		"host, no policy, default on":  {nil, true, host, "", "", ""},
		"host, policy off, default on": {&PoolRuntime{}, true, host, ReasonHostCommandsNotAllowed, "run.image", "images only"},
		"host, policy on":              {&PoolRuntime{AllowHostCommands: true}, false, host, "", "", ""},
		"mount under a root":           {roots, false, mounted("/scratch/jobs/x/y"), "", "", ""},
		"mount is a root":              {roots, false, mounted("/data"), "", "", ""},
		"mount outside the roots":      {roots, false, mounted("/etc"), ReasonMountNotAllowed, "run.mounts[1].source", "(/data, /scratch/jobs)"},
		"mount beside a root":          {roots, false, mounted("/database"), ReasonMountNotAllowed, "run.mounts[1].source", ""},
		"mount above a root":           {roots, false, mounted("/scratch"), ReasonMountNotAllowed, "run.mounts[1].source", ""},
		"mount escaping a root":        {roots, false, mounted("/data/../etc"), ReasonMountNotAllowed, "run.mounts[1].source", ""},
		"mount, pool without roots":    {nil, true, mounted("/data"), ReasonMountNotAllowed, "run.mounts[0].source", "(none)"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			fe := CheckRuntime(tt.pool, tt.dflt, tt.run)
			if tt.reason == "" {
				if fe != nil {
					t.Fatalf("CheckRuntime = %v, want nil", fe)
				}
				return
			}
			if fe == nil || fe.Reason != tt.reason || fe.Field != tt.field || !strings.Contains(fe.Message, tt.message) {
				t.Fatalf("CheckRuntime = %v, want %s on %s saying %q", fe, tt.reason, tt.field, tt.message)
			}
		})
	}
}

func TestPoolConfigRuntimeValidate(t *testing.T) {
	tests := map[string]struct {
		roots  []string
		reason Reason
	}{
		"good":          {[]string{"/data", "/scratch/jobs"}, ""},
		"relative":      {[]string{"data"}, ReasonInvalidValue},
		"root":          {[]string{"/"}, ReasonInvalidValue},
		"trailing":      {[]string{"/data/"}, ReasonInvalidValue},
		"dev":           {[]string{"/dev"}, ReasonMountNotAllowed},
		"under proc":    {[]string{"/proc/sys"}, ReasonMountNotAllowed},
		"too many":      {slices.Repeat([]string{"/d"}, MaxMountRoots+1), ReasonOutOfRange},
		"just the most": {slices.Repeat([]string{"/d"}, MaxMountRoots), ""},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			err := PoolConfig{Policy: PolicyBinpack, Runtime: &PoolRuntime{MountRoots: tt.roots}}.Validate("gpu-a")
			var ve *ValidationError
			switch {
			case tt.reason == "" && err != nil:
				t.Fatalf("Validate = %v", err)
			case tt.reason != "" && (!errors.As(err, &ve) || ve.Fields[0].Reason != tt.reason):
				t.Fatalf("Validate = %v, want %s", err, tt.reason)
			}
		})
	}
}

// TestCleanPathPattern holds the pattern to path.Clean: an absolute path
// matches exactly when Clean leaves it as it is (and it is not /).
func TestCleanPathPattern(t *testing.T) {
	for _, p := range []string{"/a", "/a/b", "/a/", "/a//b", "/./a", "/a/.", "/a/..", "/..", "/.a", "/..a", "/a..",
		"/...", "/a/.b/c", "/", "//", "/a b", "/é"} {
		want := path.Clean(p) == p && p != "/"
		if got := isCleanPath(p); got != want {
			t.Errorf("%q: pattern says %v, path.Clean says %v", p, got, want)
		}
	}
}

func TestRunArgvAndKind(t *testing.T) {
	tests := []struct {
		run             RunSpec
		argv            []string
		container, host bool
	}{
		{RunSpec{Command: []string{"sh", "-c"}, Args: []string{"true"}}, []string{"sh", "-c", "true"}, false, true},
		{RunSpec{Command: []string{"sh"}}, []string{"sh"}, false, true},
		{RunSpec{Image: "busybox", Command: []string{"sh"}}, []string{"sh"}, true, false},
		{RunSpec{Duration: 1}, nil, false, false},
	}
	for i, tt := range tests {
		if got := tt.run.Argv(); !slices.Equal(got, tt.argv) {
			t.Errorf("%d: Argv = %q, want %q", i, got, tt.argv)
		}
		if tt.run.IsContainer() != tt.container || tt.run.IsHostCommand() != tt.host {
			t.Errorf("%d: container %v host %v, want %v %v", i, tt.run.IsContainer(), tt.run.IsHostCommand(), tt.container, tt.host)
		}
	}
	// Argv never writes into the request's Command.
	cmd := make([]string, 1, 4)
	cmd[0] = "a"
	r := RunSpec{Command: cmd, Args: []string{"b"}}
	_ = r.Argv()
	if got := cmd[:2]; got[1] != "" {
		t.Fatalf("Argv wrote into Command's array: %q", got)
	}
}

func TestImageRef(t *testing.T) {
	digest := "sha256:" + strings.Repeat("ab", 32)
	tests := map[string]string{
		"busybox":                           "index.docker.io/library/busybox:latest",
		"ghcr.io/acme/train:v3":             "ghcr.io/acme/train:v3",
		"registry.example:5000/x@" + digest: "registry.example:5000/x@" + digest,
		"":                                  "",
		"Not A Ref":                         "",
	}
	for in, want := range tests {
		if got := ImageRef(RunSpec{Image: in}); got != want {
			t.Errorf("ImageRef(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestRegistryCredentials(t *testing.T) {
	tests := map[string]struct {
		creds  RegistryCredentials
		reason Reason
	}{
		"password":       {RegistryCredentials{Registries: map[string]RegistryAuth{"ghcr.io": {Username: "u", Password: "p"}}}, ""},
		"token":          {RegistryCredentials{Registries: map[string]RegistryAuth{"registry.example:5000": {Token: "t"}}}, ""},
		"both":           {RegistryCredentials{Registries: map[string]RegistryAuth{"ghcr.io": {Username: "u", Password: "p", Token: "t"}}}, ReasonInvalidValue},
		"no password":    {RegistryCredentials{Registries: map[string]RegistryAuth{"ghcr.io": {Username: "u"}}}, ReasonMissingField},
		"not a host":     {RegistryCredentials{Registries: map[string]RegistryAuth{"ghcr.io/acme": {Token: "t"}}}, ReasonInvalidValue},
		"other tenant":   {RegistryCredentials{Tenant: "other"}, ReasonTenantMismatch},
		"nothing stored": {RegistryCredentials{}, ""},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			err := tt.creds.Validate("acme")
			var ve *ValidationError
			switch {
			case tt.reason == "" && err != nil:
				t.Fatalf("Validate = %v", err)
			case tt.reason != "" && (!errors.As(err, &ve) || ve.Fields[0].Reason != tt.reason):
				t.Fatalf("Validate = %v, want %s", err, tt.reason)
			}
		})
	}
	c := RegistryCredentials{Registries: map[string]RegistryAuth{"index.docker.io": {Username: "u", Password: "hunter2"}}}
	ref, err := ParseImage("acme/private:v1")
	if err != nil {
		t.Fatal(err)
	}
	if a, ok := c.For(ref); !ok || a.Password != "hunter2" {
		t.Fatalf("For(%s) = %v, %v: a Docker Hub image takes the index.docker.io login", ref, a, ok)
	}
	if _, ok := c.For(mustRef(t, "ghcr.io/acme/x")); ok {
		t.Fatal("a login for Docker Hub was offered to ghcr.io")
	}
}

func mustRef(t *testing.T, s string) name.Reference {
	t.Helper()
	r, err := ParseImage(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestRegistryAuthNeverPrinted: every way a login can reach a log or an
// error message leaves its secret out.
func TestRegistryAuthNeverPrinted(t *testing.T) {
	a := RegistryAuth{Username: "deploy", Password: "hunter2"}
	tok := RegistryAuth{Token: "s3cr3t-token"}
	creds := RegistryCredentials{Tenant: "acme", Registries: map[string]RegistryAuth{"ghcr.io": a, "quay.io": tok}}
	var logged bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&logged, nil))
	log.Info("pull", "auth", a, "token", tok)
	slog.New(slog.NewTextHandler(&logged, nil)).Info("pull", "auth", a)
	out := []string{fmt.Sprint(a), fmt.Sprintf("%v %+v %#v %s", a, a, a, tok), fmt.Sprintf("%+v %#v", creds, creds), logged.String()}
	for _, s := range out {
		if strings.Contains(s, "hunter2") || strings.Contains(s, "s3cr3t") {
			t.Fatalf("a secret was printed: %s", s)
		}
	}
	if !strings.Contains(out[0], "deploy") {
		t.Fatalf("the user name should stay visible: %s", out[0])
	}
}
