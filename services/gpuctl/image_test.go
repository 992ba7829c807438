package gpuctl

import (
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestSubmitImage: --image and the container flags build run.image and its
// fields (a command after -- replaces the image's ENTRYPOINT; no default
// duration, which would be a time limit); bad values are refused before
// anything is sent, with contracts' reasons.
func TestSubmitImage(t *testing.T) {
	h := start(t)
	tests := map[string]struct {
		args []string
		want contracts.RunSpec
	}{
		"image and command": {[]string{"--image", "busybox", "--", "sh", "-c", "echo hi"},
			contracts.RunSpec{Image: "busybox", Command: []string{"sh", "-c", "echo hi"}}},
		"image alone": {[]string{"--image", "ghcr.io/acme/train:v3"}, contracts.RunSpec{Image: "ghcr.io/acme/train:v3"}},
		"everything": {[]string{"--image", "ghcr.io/acme/train:v3", "--workdir", "/work", "--user", "1000:1000", "--shm-size", "2Gi",
			"--mount", "/data/imagenet:/data:ro", "--mount", "/scratch/a:/scratch", "--env", "A=1,B=2", "--duration", "1h", "--memory", "8Gi",
			"--", "python", "train.py"},
			contracts.RunSpec{Image: "ghcr.io/acme/train:v3", Command: []string{"python", "train.py"}, WorkingDir: "/work", User: "1000:1000",
				ShmSizeMiB: 2048, Env: map[string]string{"A": "1", "B": "2"}, Duration: contracts.Duration(time.Hour),
				Mounts: []contracts.Mount{{Source: "/data/imagenet", Target: "/data", ReadOnly: true}, {Source: "/scratch/a", Target: "/scratch"}}}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			id := strings.ReplaceAll(name, " ", "-")
			args := append([]string{"submit", "--id", id}, tt.args...)
			if code, out, errOut := h.run(args...); code != ExitOK || !strings.Contains(out, "job "+id+" submitted") {
				t.Fatalf("submit: %d %q %q", code, out, errOut)
			}
			if diff := cmp.Diff(tt.want, h.submitted(id).Run); diff != "" {
				t.Fatalf("run spec (-want +got):\n%s", diff)
			}
		})
	}

	before := len(h.messages(contracts.SubjectSubmitAll))
	refused := map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"bad reference":    {[]string{"--image", "Not:A:Ref"}, ExitError, "run.image: image_invalid"},
		"mount without :":  {[]string{"--image", "busybox", "--mount", "/data"}, ExitUsage, "want SOURCE:TARGET"},
		"mount bad mode":   {[]string{"--image", "busybox", "--mount", "/a:/b:rx"}, ExitUsage, "want SOURCE:TARGET"},
		"mount onto /proc": {[]string{"--image", "busybox", "--mount", "/data:/proc"}, ExitError, "run.mounts[0].target: mount_not_allowed"},
		"relative source":  {[]string{"--image", "busybox", "--mount", "data:/data"}, ExitError, "run.mounts[0].source: invalid_value"},
		"shm unit":         {[]string{"--image", "busybox", "--shm-size", "1GB"}, ExitUsage, `memory "1GB"`},
		"user format":      {[]string{"--image", "busybox", "--user", "a:b:c"}, ExitError, "run.user: invalid_value"},
		"mount no image":   {[]string{"--mount", "/data:/data", "--", "true"}, ExitError, "run.mounts: conflicting_run_spec"},
		"env without =":    {[]string{"--image", "busybox", "--env", "A"}, ExitUsage, `--env "A": want KEY=VALUE`},
		"workdir relative": {[]string{"--image", "busybox", "--workdir", "work"}, ExitError, "run.workingDir: invalid_value"},
	}
	for name, tt := range refused {
		t.Run(name, func(t *testing.T) {
			code, _, errOut := h.run(append([]string{"submit"}, tt.args...)...)
			if code != tt.code || !strings.Contains(errOut, tt.stderr) {
				t.Fatalf("code %d stderr %q; want %d with %q", code, errOut, tt.code, tt.stderr)
			}
		})
	}
	if after := len(h.messages(contracts.SubjectSubmitAll)); after != before {
		t.Fatalf("refused submits published %d messages", after-before)
	}
}
