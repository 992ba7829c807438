package chaos

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
)

// Proxy is a TCP forwarder on loopback that the suite can cut: the
// network partition of one NATS node without iptables. Every link of that
// node (its client port and each route to and from it) goes through a
// Proxy; cutting them all isolates the node as a dead switch port would.
//
// Cut closes every connection it carries and refuses new ones (accepted
// and closed at once) until Heal: both ends see their peer go at once, as
// with a reset. A partition that drops packets silently would be found
// only by NATS's ping timeouts (two minutes by default for clients); the
// suite tests failover, not ping settings.
type Proxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]struct{}
	// Cuts counts the connections closed by Cut or refused while cut, for
	// the report: a cut that closed nothing cut nothing.
	closed, refused int
	wg              sync.WaitGroup
}

// NewProxy listens on 127.0.0.1 (any free port) and forwards each
// connection to target (host:port).
func NewProxy(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("proxy to %s: %w", target, err)
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the proxy's port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.cut {
			p.refused++
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		p.mu.Unlock()
		p.wg.Add(1)
		go p.forward(c)
	}
}

func (p *Proxy) forward(c net.Conn) {
	defer p.wg.Done()
	u, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = c.Close()
		return
	}
	p.mu.Lock()
	if p.cut { // cut while dialling
		p.refused++
		p.mu.Unlock()
		_ = c.Close()
		_ = u.Close()
		return
	}
	p.conns[c], p.conns[u] = struct{}{}, struct{}{}
	p.mu.Unlock()
	var once sync.Once
	done := func() {
		once.Do(func() {
			_ = c.Close()
			_ = u.Close()
			p.mu.Lock()
			delete(p.conns, c)
			delete(p.conns, u)
			p.mu.Unlock()
		})
	}
	var wg sync.WaitGroup
	wg.Go(func() { _, _ = io.Copy(u, c); done() })
	wg.Go(func() { _, _ = io.Copy(c, u); done() })
	wg.Wait()
}

// Cut closes every connection through the proxy and refuses new ones
// until Heal. It returns how many connections it closed.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	n := 0
	for c := range p.conns {
		_ = c.Close()
		n++
	}
	p.closed += n / 2 // both halves of each link are in conns
	return n / 2
}

// Heal lets connections through again.
func (p *Proxy) Heal() {
	p.mu.Lock()
	p.cut = false
	p.mu.Unlock()
}

// Stats returns the links closed by Cut and refused while cut so far.
func (p *Proxy) Stats() (closed, refused int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed, p.refused
}

// Close stops the proxy and closes every connection through it.
func (p *Proxy) Close() error {
	err := p.ln.Close()
	p.Cut()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}
