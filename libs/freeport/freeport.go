// Package freeport picks TCP ports on 127.0.0.1 for tests whose servers
// must know their ports before they start: a cluster's routes name each
// other's, and a member killed and restarted comes back on its port.
//
// A port taken by listening on :0 and then let go lies in the kernel's
// ephemeral range, which the kernel hands out again, to the next listener
// on :0 or as the local end of any outgoing connection, before the server
// meant for it binds it ("address already in use"; a bus cluster test
// lost a member that way). Ports here are chosen below that range, where
// only an explicit bind takes them.
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
)

// lowest is the bottom of the range ports are chosen from: above the
// well-known and most registered services' ports.
const lowest = 20000

// Ports returns n distinct ports free on 127.0.0.1 now.
func Ports(t testing.TB, n int) []int {
	t.Helper()
	top := ephemeralStart()
	out := make([]int, 0, n)
	held := make([]net.Listener, 0, n)
	defer func() {
		for _, l := range held {
			_ = l.Close()
		}
	}()
	// Held until all are chosen, so they are distinct.
	for tries := 0; len(out) < n && top > lowest && tries < 100*n; tries++ {
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(lowest+rand.IntN(top-lowest)))
		if err != nil {
			continue // taken
		}
		held = append(held, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	for len(out) < n { // no range known below the ephemeral one
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("reserve a port: %v", err)
		}
		held = append(held, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	return out
}

// Port returns one port free on 127.0.0.1 now.
func Port(t testing.TB) int {
	t.Helper()
	return Ports(t, 1)[0]
}

// Addr is 127.0.0.1:Port(t).
func Addr(t testing.TB) string {
	t.Helper()
	return fmt.Sprintf("127.0.0.1:%d", Port(t))
}

// ephemeralStart is the first port of Linux's ephemeral range, or 0 when
// it cannot be read (another system: Ports falls back to :0).
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return n
}
