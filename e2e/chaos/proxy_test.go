package chaos

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"
)

// echoServer answers each line with the same line.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	return ln.Addr().String()
}

// roundTrip sends a line over c and reads it back; an error means the
// link is down.
func roundTrip(c net.Conn, line string) (string, error) {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, line+"\n"); err != nil {
		return "", err
	}
	got, err := bufio.NewReader(c).ReadString('\n')
	return got, err
}

// TestProxyCutAndHeal: a cut closes the links through the proxy and
// refuses new ones; a heal lets new links through. This is what makes the
// suite's partition real.
func TestProxyCutAndHeal(t *testing.T) {
	p, err := NewProxy(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })

	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got, err := roundTrip(c, "before"); err != nil || got != "before\n" {
		t.Fatalf("through the proxy: %q, %v", got, err)
	}

	if n := p.Cut(); n != 1 {
		t.Errorf("Cut closed %d links, want 1", n)
	}
	if got, err := roundTrip(c, "during"); err == nil {
		t.Fatalf("a link survived the cut: read %q", got)
	}
	c2, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err) // the listener stays: the peer is refused after accept
	}
	defer c2.Close()
	if got, err := roundTrip(c2, "new while cut"); err == nil {
		t.Fatalf("a new link went through a cut proxy: read %q", got)
	}

	p.Heal()
	c3, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	if got, err := roundTrip(c3, "after"); err != nil || got != "after\n" {
		t.Fatalf("after heal: %q, %v", got, err)
	}
	closed, refused := p.Stats()
	if closed != 1 || refused != 1 {
		t.Errorf("stats: closed %d refused %d, want 1 and 1", closed, refused)
	}
}
