package runner

import "syscall"

// commandAttr puts a command in its own process group, so a stop reaches
// every process it forked, and kills it when its shim dies (SIGKILL of the
// shim included), so it never runs on unsupervised.
func commandAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
