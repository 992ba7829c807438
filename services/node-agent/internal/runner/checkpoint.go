package runner

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// LatestFile, in a job's checkpoint directory, names its last complete
// checkpoint: a job writes it last, by renaming a temporary file over it.
const LatestFile = "LATEST"

// LatestCheckpoint returns the checkpoint LATEST names in dir, when it
// names an existing subdirectory of dir: a LATEST naming anything else (a
// path, a directory that does not exist) is not a complete checkpoint.
func LatestCheckpoint(dir string) (name string, ok bool) {
	b, err := os.ReadFile(filepath.Join(dir, LatestFile))
	if err != nil {
		return "", false
	}
	name = strings.TrimSpace(string(b))
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\\\x00\n") {
		return "", false
	}
	if fi, err := os.Stat(filepath.Join(dir, name)); err != nil || !fi.IsDir() {
		return "", false
	}
	return name, true
}

// simState is what a simulated run's checkpoint holds, in <ckpt>/state.
type simState struct {
	Progress contracts.Duration `json:"progress"` // how much of Duration was done
	Duration contracts.Duration `json:"duration"`
}

const simStateFile = "state"

// writeSimCheckpoint saves s as the job's next checkpoint, ckpt-<n> with n
// above every ckpt-<n> there (attempts share the directory), then points
// LATEST at it: the protocol a real job follows too. The directory is
// made here, by the run's first checkpoint (Local.prepare leaves it to
// this for a simulated run).
func writeSimCheckpoint(dir string, s simState) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return "", err
	}
	n := 0
	for _, e := range entries {
		if v, err := strconv.Atoi(strings.TrimPrefix(e.Name(), "ckpt-")); err == nil && strings.HasPrefix(e.Name(), "ckpt-") && v > n {
			n = v
		}
	}
	name := "ckpt-" + strconv.Itoa(n+1)
	if err := os.Mkdir(filepath.Join(dir, name), 0o755); err != nil {
		return "", err
	}
	if err := writeJSON(filepath.Join(dir, name, simStateFile), s); err != nil {
		return "", err
	}
	if err := writeAtomic(filepath.Join(dir, LatestFile), []byte(name+"\n")); err != nil {
		return "", err
	}
	return name, nil
}

// readSimCheckpoint reads the state a simulated run saved in ckpt.
func readSimCheckpoint(ckpt string) (simState, error) {
	var s simState
	ok, err := readJSON(filepath.Join(ckpt, simStateFile), &s)
	if err == nil && !ok {
		err = errors.New("no state file")
	}
	if err != nil {
		return simState{}, fmt.Errorf("checkpoint %s: %w", ckpt, err)
	}
	return s, nil
}
