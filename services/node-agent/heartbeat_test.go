package nodeagent_test

import (
	"bytes"
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// dyingServer stands between an agent and its NATS server and plays the
// server's death at the worst moment: it swallows what the agent sends
// from the moment it is armed until it has swallowed a heartbeat publish
// (the server died with the request unread), then drops every connection
// and lets the next ones through (the agent reconnects to a live member).
type dyingServer struct {
	ln     net.Listener
	target string

	mu        sync.Mutex
	armed     bool
	conns     []net.Conn
	swallowed chan struct{}
}

func newDyingServer(t *testing.T, target string) *dyingServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d := &dyingServer{ln: ln, target: target, swallowed: make(chan struct{})}
	t.Cleanup(func() { _ = ln.Close(); d.drop() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			d.mu.Lock()
			d.conns = append(d.conns, c, s)
			d.mu.Unlock()
			go func() { _, _ = io.Copy(c, s); _ = c.Close() }()
			go d.upstream(c, s)
		}
	}()
	return d
}

func (d *dyingServer) upstream(c, s net.Conn) {
	defer s.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := c.Read(buf)
		if err != nil {
			return
		}
		d.mu.Lock()
		armed := d.armed
		if armed && bytes.Contains(buf[:n], []byte("gp.heartbeat.")) {
			d.armed = false
			close(d.swallowed)
		}
		d.mu.Unlock()
		if armed {
			continue // never reaches the server
		}
		if _, err := s.Write(buf[:n]); err != nil {
			return
		}
	}
}

func (d *dyingServer) drop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns {
		_ = c.Close()
	}
	d.conns = nil
}

// TestHeartbeatsOutliveTheirServersDeath: the NATS server an agent is
// connected to dies with a heartbeat publish unacknowledged. The agent
// reconnects at once; its heartbeat must reach the stream soon enough
// that the node is never silent for the resource manager's heartbeat
// timeout (three intervals by default). Waiting out a 5 s ack for the
// lost request left the node silent about 7 s with the default 2 s
// interval: lost, and its runs stopped.
func TestHeartbeatsOutliveTheirServersDeath(t *testing.T) {
	if testing.Short() {
		t.Skip("runs through real heartbeat intervals (about 10 s)")
	}
	b := connect(t)
	d := newDyingServer(t, b.srv.Addr().String())
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	const node = "hb-01"
	ab, err := bus.Connect(ctx, bus.Config{URL: "nats://" + d.ln.Addr().String(), Name: nodeagent.ServiceName + "-" + node,
		CredsFile: natstest.Node(t, b.srv, node), SkipProvision: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ab.Close(context.Background()) })
	cfg := testConfig(t, node)
	cfg.HeartbeatInterval = nodeagent.DefaultHeartbeatInterval
	timeout := 3 * cfg.HeartbeatInterval // the resource manager's default
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- nodeagent.RunWithBus(runCtx, cfg, ab, nil) }()
	t.Cleanup(func() { stop(); <-done })

	var mu sync.Mutex
	var stored []time.Time
	go func() {
		_ = b.Follow(runCtx, bus.FollowSpec{Stream: contracts.StreamHeartbeats,
			FilterSubjects: []string{contracts.SubjectHeartbeat(node)}}, func(_ context.Context, m *bus.Msg) error {
			mu.Lock()
			stored = append(stored, m.Timestamp)
			mu.Unlock()
			return nil
		}, nil)
	}()
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(stored) }
	eventually(t, "a first heartbeat", func() bool { return count() >= 1 })
	d.mu.Lock()
	d.armed = true
	d.mu.Unlock()
	select {
	case <-d.swallowed:
	case <-ctx.Done():
		t.Fatal("no heartbeat publish reached the dying server")
	}
	died := time.Now()
	d.drop()
	before := count()
	eventually(t, "heartbeats after the server's death", func() bool { return count() >= before+2 })
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i < len(stored); i++ {
		if gap := stored[i].Sub(stored[i-1]); gap > timeout {
			t.Errorf("no heartbeat stored for %s (around the server's death at %s): the node would be lost after %s",
				gap.Round(time.Millisecond), died.Format(time.RFC3339Nano), timeout)
		}
	}
}

// slowRecovery is a local runner whose recovery of a previous agent's runs
// waits until released: a restarted agent with a long replay ahead of it.
type slowRecovery struct {
	*runner.Local
	release chan struct{}
}

func (s slowRecovery) Recover() ([]runner.Leftover, error) {
	<-s.release
	return s.Local.Recover()
}

// TestHeartbeatsWhileRecovering: a restarted agent heartbeats while it is
// still recovering the runs it left behind. It used to start heartbeating
// only once recovered; a replay longer than the resource manager's
// heartbeat timeout (twenty agents of one fleet restarting on a busy
// cluster took 10 s) had every machine declared lost and its live runs
// stopped after a one-second restart.
func TestHeartbeatsWhileRecovering(t *testing.T) {
	b := connect(t)
	const node = "recovering-01"
	cfg := testConfig(t, node)
	release := make(chan struct{})
	cfg.Runner = slowRecovery{Local: &runner.Local{LogDir: cfg.LogDir}, release: release}
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
	hb := record[contracts.Heartbeat](t, b, contracts.StreamHeartbeats, contracts.SubjectHeartbeat(node))
	startAgent(t, b, cfg)
	eventually(t, "heartbeats while the runs are recovered", func() bool { return len(hb.all()) >= 3 })
	if n := len(inv.all()); n != 0 {
		t.Fatalf("%d inventories before recovery finished; want none", n)
	}
	close(release)
	eventually(t, "the inventory once recovered", func() bool { return len(inv.all()) >= 1 })
}
