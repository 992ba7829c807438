package resourcemanager

import (
	"fmt"
	"os"
	"strings"
)

// Failpoints are crash drills: named places where the process kills itself
// with SIGKILL, so that a test can prove what survives a crash there. The
// environment variable EnvFailpoint names one; DefaultConfig reads it once
// (Config.Failpoint). Unset, or set to another service's failpoint (not
// "rm-..."), nothing happens anywhere. Never set it in production.
type Failpoint string

// EnvFailpoint is the environment variable that arms a failpoint.
const EnvFailpoint = "GPUPLANE_FAILPOINT"

const (
	// FailAfterVerify: a plan item was verified under its node's lock and
	// the committed ledger entry is about to be published; the process
	// dies before it is. The plan is not acknowledged, so it comes again.
	FailAfterVerify Failpoint = "rm-after-verify"
	// FailAfterCommit: the committed ledger entry is stored; the process
	// dies before it is applied in memory and before the plan is
	// acknowledged. The redelivered item must be a no-op.
	FailAfterCommit Failpoint = "rm-after-commit"
)

// Failpoints lists the resource manager's failpoints.
var Failpoints = []Failpoint{FailAfterVerify, FailAfterCommit}

// failpointPrefix marks the resource manager's failpoints among every
// service's values of EnvFailpoint.
const failpointPrefix = "rm-"

// failpointFromEnv is EnvFailpoint when it names one of ours ("rm-..."),
// "" otherwise.
func failpointFromEnv() Failpoint {
	if v := os.Getenv(EnvFailpoint); strings.HasPrefix(v, failpointPrefix) {
		return Failpoint(v)
	}
	return ""
}

// validate reports an "rm-" failpoint that does not exist: a drill that
// would silently test nothing.
func (f Failpoint) validate() error {
	if f == "" {
		return nil
	}
	for _, k := range Failpoints {
		if f == k {
			return nil
		}
	}
	return fmt.Errorf("failpoint %q; want one of %v or none", f, Failpoints)
}

// failpoint kills the process with SIGKILL when at is the armed
// failpoint; otherwise it does nothing. It never returns when it fires: no
// instruction of the caller runs after the failpoint.
func (s *server) failpoint(at Failpoint) {
	if s.cfg.Failpoint != at || at == "" {
		return
	}
	s.log.Warn("failpoint reached: killing this process", "failpoint", string(at))
	if p, err := os.FindProcess(os.Getpid()); err == nil {
		_ = p.Kill() // SIGKILL: no deferred function, no flush, no ack
	}
	select {} // the signal is on its way; this goroutine goes no further
}
