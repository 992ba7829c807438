// Package gctune sets the garbage collector of a gpuplane process: a
// larger target than the runtime's default, bounded by a soft memory
// limit, unless the environment (GOGC, GOMEMLIMIT) says otherwise. Every
// service binary calls Tune at start, the all-in-one and each separate
// service alike (the Tiltfile and the Kubernetes deploy run those).
package gctune

import (
	"bufio"
	"bytes"
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
)

// DefaultPercent is the garbage collector's target (GOGC) of a gpuplane
// process: the heap may grow to four times what is live between
// collections instead of twice. Each message a job costs is decoded by
// several readers into short-lived values, in a separate service as in
// the all-in-one (which runs NATS, every service and every simulated
// agent in one heap): in the all-in-one at the runtime's default of 100, collection took a fifth of a burst's CPU
// (BenchmarkBurst R1, 2,000 jobs: 1.47-1.57 cpu-ms/job at GOGC=100 against
// 1.11-1.26 at 300, alternated in one minute at load 4, issue 17).
const DefaultPercent = 300

// gcMemoryShare is the share of the machine's (or cgroup's) memory that
// Tune sets as the soft memory limit: past it the collector runs as
// often as it must, so the larger target never costs the memory a
// machine does not have.
const gcMemoryShare = 0.75

// Tune sets the collector's target to percent unless the environment
// sets GOGC (an operator's choice stands), and, unless it sets
// GOMEMLIMIT, a soft memory limit of three quarters of the memory the
// process may use (the cgroup's limit or the machine's, whichever is
// lower; none when neither is known). It returns what restores the
// settings it changed. Both settings are the process's: every service
// binary calls it once at start, and the benchmarks that run the
// platform in their own process call it to run it the same way.
func Tune(percent int) (restore func()) {
	var undo []func()
	if _, set := os.LookupEnv("GOGC"); !set && percent > 0 {
		prev := debug.SetGCPercent(percent)
		undo = append(undo, func() { debug.SetGCPercent(prev) })
	}
	if _, set := os.LookupEnv("GOMEMLIMIT"); !set {
		if total := memoryAvailable(); total > 0 {
			prev := debug.SetMemoryLimit(int64(float64(total) * gcMemoryShare))
			undo = append(undo, func() { debug.SetMemoryLimit(prev) })
		}
	}
	return func() {
		for _, f := range undo {
			f()
		}
	}
}

// memoryAvailable is the memory this process may use in bytes: the
// lower of the cgroup v2 limit and the machine's total, 0 when neither
// can be read.
func memoryAvailable() uint64 {
	total := machineMemory()
	if limit := cgroupMemoryLimit(); limit > 0 && (total == 0 || limit < total) {
		total = limit
	}
	return total
}

// machineMemory is MemTotal of /proc/meminfo in bytes, 0 when unknown.
func machineMemory() uint64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			return parseMemInfoKB(v)
		}
	}
	return 0
}

// parseMemInfoKB reads a /proc/meminfo value ("  131072 kB") in bytes,
// 0 when it is not one.
func parseMemInfoKB(v string) uint64 {
	fields := strings.Fields(v)
	if len(fields) != 2 || fields[1] != "kB" {
		return 0
	}
	kb, err := strconv.ParseUint(fields[0], 10, 64)
	if err != nil || kb > math.MaxUint64/1024 {
		return 0
	}
	return kb * 1024
}

// cgroupMemoryLimit is this process's cgroup memory limit in bytes: v2's
// memory.max, else v1's memory.limit_in_bytes (a Kubernetes node may run
// either); 0 when there is none ("max") or neither can be read. v1 says
// "no limit" with a huge number, which memoryAvailable's comparison with
// the machine's memory discards.
func cgroupMemoryLimit() uint64 {
	for _, f := range []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"} {
		if b, err := os.ReadFile(f); err == nil {
			if n := parseCgroupMax(b); n > 0 {
				return n
			}
		}
	}
	return 0
}

// parseCgroupMax reads a cgroup v2 memory.max file (a byte count, or
// "max" for none: 0) or a v1 memory.limit_in_bytes file (a byte count).
func parseCgroupMax(b []byte) uint64 {
	n, err := strconv.ParseUint(string(bytes.TrimSpace(b)), 10, 64)
	if err != nil {
		return 0
	}
	return n
}
