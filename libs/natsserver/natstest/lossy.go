package natstest

import (
	"net"
	"net/url"
	"sync"
	"testing"

	"github.com/gpuplane/gpuplane/libs/natsserver"
)

// LossyProxy stands between clients and a NATS server and loses what is
// in flight as a NATS server that dies does: Silence drops every byte
// either way while the connections stay open (a server that stopped
// answering), and Die then closes them, so a client reconnects (through
// the proxy, as to a surviving member). A request sent in between is
// never answered, on the new connection either: nats.go waits for its
// answer until the request's context ends (its 5 s default only when the
// context has no deadline). Tests of what a lost answer must not hold
// (a lease renewal, a stream look) connect through one.
type LossyProxy struct {
	l      net.Listener
	target string

	mu     sync.Mutex
	silent bool
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

// NewLossyProxy starts a proxy to srv's client port on 127.0.0.1; it stops
// with the test.
func NewLossyProxy(t testing.TB, srv *natsserver.Server) *LossyProxy {
	t.Helper()
	u, err := url.Parse(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &LossyProxy{l: l, target: u.Host, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		_ = p.l.Close()
		p.Die()
		p.wg.Wait()
	})
	return p
}

// URL is the proxy's client URL.
func (p *LossyProxy) URL() string { return "nats://" + p.l.Addr().String() }

func (p *LossyProxy) accept() {
	for {
		in, err := p.l.Accept()
		if err != nil {
			return // closed
		}
		out, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = in.Close()
			continue
		}
		p.mu.Lock()
		p.conns[in], p.conns[out] = struct{}{}, struct{}{}
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(out, in) })
		p.wg.Go(func() { p.pipe(in, out) })
	}
}

// pipe copies src to dst, dropping what it reads while the proxy is
// silent, until either side closes.
func (p *LossyProxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		p.mu.Lock()
		silent := p.silent
		p.mu.Unlock()
		if n > 0 && !silent {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil { // closed, or reset: the same here
			break
		}
	}
	_ = dst.Close()
	_ = src.Close()
	p.mu.Lock()
	delete(p.conns, dst)
	delete(p.conns, src)
	p.mu.Unlock()
}

// Silence loses every byte from now on, either way.
func (p *LossyProxy) Silence() {
	p.mu.Lock()
	p.silent = true
	p.mu.Unlock()
}

// Die closes every connection, losing what Silence held back; new ones
// are forwarded again.
func (p *LossyProxy) Die() {
	p.mu.Lock()
	p.silent = false
	open := make([]net.Conn, 0, len(p.conns))
	for c := range p.conns {
		open = append(open, c)
	}
	p.mu.Unlock()
	for _, c := range open {
		_ = c.Close()
	}
}
