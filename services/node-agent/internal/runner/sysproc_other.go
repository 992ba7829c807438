//go:build !linux

package runner

import "syscall"

// commandAttr puts a command in its own process group. Only Linux has
// Pdeathsig: elsewhere a command whose shim is killed lives on until the
// agent notices the shim is gone and kills its group.
func commandAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
