package scheduler

import (
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestHostCommandsByFlag: the service's default runs images only, so a
// host command is rejected on the bus with host_commands_not_allowed while
// an image is placed, with its pool's policy in the plan item; with
// -allow-host-commands the same command is placed.
func TestHostCommandsByFlag(t *testing.T) {
	t.Parallel()
	host := func(id string) contracts.JobRequest {
		r := request(id, 1, h100)
		r.Run = contracts.RunSpec{Command: []string{"nvidia-smi"}}
		return r
	}
	for _, allow := range []bool{false, true} {
		e := newEnv(t)
		e.cfg.AllowHostCommands = allow
		e.start()
		e.inventory("n1", "gpu", h100, 2)
		img := request("img", 1, h100)
		img.Run = contracts.RunSpec{Image: "busybox", Command: []string{"true"}}
		e.submit("acme", img)
		e.submit("acme", host("cmd"))
		if it := e.waitItem("acme", "img", 1, ""); it.Runtime == nil || it.Runtime.AllowHostCommands != allow {
			t.Fatalf("allow %v: the image's plan item carries runtime %+v", allow, it.Runtime)
		}
		if !allow {
			ev := e.waitEvent("acme", "cmd", contracts.EventRejected)
			if ev.Reason != contracts.ReasonHostCommandsNotAllowed || len(ev.Errors) != 1 || ev.Errors[0].Field != "run.image" {
				t.Fatalf("rejection %s %v, want host_commands_not_allowed on run.image", ev.Reason, ev.Errors)
			}
			continue
		}
		if it := e.waitItem("acme", "cmd", 1, ""); it.NodeID != "n1" {
			t.Fatalf("the host command was placed on %q", it.NodeID)
		}
	}
}
