package freeport_test

import (
	"net"
	"strconv"
	"testing"

	"github.com/gpuplane/gpuplane/libs/freeport"
)

// TestPortsAreDistinctFreeAndOutsideTheEphemeralRange: every port can be
// bound, none twice, and none lies where the kernel hands ports out for
// :0 or an outgoing connection.
func TestPortsAreDistinctFreeAndOutsideTheEphemeralRange(t *testing.T) {
	ports := freeport.Ports(t, 12)
	seen := map[int]bool{}
	var held []net.Listener
	defer func() {
		for _, l := range held {
			_ = l.Close()
		}
	}()
	for _, p := range ports {
		if seen[p] {
			t.Fatalf("port %d twice in %v", p, ports)
		}
		seen[p] = true
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			t.Fatalf("port %d of %v cannot be bound: %v", p, ports, err)
		}
		held = append(held, l)
	}
	if start := freeport.EphemeralStart(); start > 20000 {
		for _, p := range ports {
			if p >= start {
				t.Fatalf("port %d is in the ephemeral range, from %d", p, start)
			}
		}
	}
}
