package natstest

import (
	"io"
	"net"
	"sync"
	"testing"
)

// ClusterOption adjusts StartClusterWith.
type ClusterOption func(*clusterConfig)

type clusterConfig struct {
	partitions bool
}

// WithPartitions routes every member's routes through proxies in this
// process, so that Partition can cut a member off from the others while
// it keeps running: the closest an in-process cluster comes to a member
// that dies without saying so (a SIGKILL, a pulled cable). A graceful
// Kill hands its leaderships over first; a partition does not.
func WithPartitions() ClusterOption {
	return func(c *clusterConfig) { c.partitions = true }
}

// routeProxy forwards the route connections one member opens to another.
// Cut closes those open and refuses new ones until Heal.
type routeProxy struct {
	l      net.Listener
	target string

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

func newRouteProxy(t testing.TB, target string) *routeProxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("route proxy: %v", err)
	}
	p := &routeProxy{l: l, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.accept)
	return p
}

func (p *routeProxy) addr() string { return p.l.Addr().String() }

func (p *routeProxy) accept() {
	for {
		in, err := p.l.Accept()
		if err != nil {
			return // closed
		}
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			_ = in.Close()
			continue
		}
		p.mu.Unlock()
		out, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = in.Close()
			continue
		}
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			_ = in.Close()
			_ = out.Close()
			continue
		}
		p.conns[in], p.conns[out] = struct{}{}, struct{}{}
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(in, out) })
		p.wg.Go(func() { p.pipe(out, in) })
	}
}

// pipe copies src to dst until either side closes (a cut, a member's
// shutdown), then closes both.
func (p *routeProxy) pipe(dst, src net.Conn) {
	_, _ = io.Copy(dst, src)
	_ = dst.Close()
	_ = src.Close()
	p.mu.Lock()
	delete(p.conns, dst)
	delete(p.conns, src)
	p.mu.Unlock()
}

func (p *routeProxy) setCut(cut bool) {
	p.mu.Lock()
	p.cut = cut
	var open []net.Conn
	if cut {
		for c := range p.conns {
			open = append(open, c)
		}
	}
	p.mu.Unlock()
	for _, c := range open {
		_ = c.Close()
	}
}

func (p *routeProxy) close() {
	_ = p.l.Close()
	p.setCut(true)
	p.wg.Wait()
}

// Partition cuts member i off from the other members: every route between
// it and them is closed and cannot be opened again until Heal. Member i
// keeps running and keeps its clients, as a member on the wrong side of a
// network partition does; the others elect new leaders for what it led
// once its silence outlasts their election timeout. It needs a cluster
// started WithPartitions.
func (c *Cluster) Partition(i int) { c.setPartitioned(i, true) }

// Heal reconnects member i to the others after Partition.
func (c *Cluster) Heal(i int) { c.setPartitioned(i, false) }

func (c *Cluster) setPartitioned(i int, cut bool) {
	c.t.Helper()
	if c.proxies == nil {
		c.t.Fatal("Partition and Heal need a cluster started WithPartitions")
	}
	for j := range c.proxies {
		if j == i {
			continue
		}
		c.proxies[i][j].setCut(cut)
		c.proxies[j][i].setCut(cut)
	}
}
