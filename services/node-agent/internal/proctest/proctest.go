// Package proctest lets tests of runs check what became of their
// processes: the runner's own tests and the agent's share it.
package proctest

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

// GroupAlive reports whether any live (not zombie) process is in process
// group pgid, as /proc tells; it fails the test when /proc cannot be read.
func GroupAlive(t testing.TB, pgid int) bool {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		// f[0] is the state (field 3), f[2] the process group (field 5).
		if len(f) > 2 && f[2] == strconv.Itoa(pgid) && f[0] != "Z" {
			return true
		}
	}
	return false
}
