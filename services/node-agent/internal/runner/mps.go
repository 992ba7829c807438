package runner

// mpsShmArgv runs argv, a share's host command, in a mount namespace of
// its own whose /dev/shm is shmDir, the /dev/shm of its GPU's MPS daemon
// (Launch.MPSShmDir): an MPS client meets its server there as well as in
// the pipe directory. unshare and sh exec in turn, so the command keeps
// the pid the shim started (its SIGUSR1 and process group hold). argv as
// is when shmDir is "" or the host's own.
func mpsShmArgv(argv []string, shmDir string) []string {
	if shmDir == "" || shmDir == "/dev/shm" {
		return argv
	}
	return append([]string{"unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
		`mount --bind "$0" /dev/shm && exec "$@"`, shmDir}, argv...)
}
