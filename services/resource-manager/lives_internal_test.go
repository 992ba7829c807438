package resourcemanager

import (
	"context"
	"log/slog"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// lossyProxy stands between the manager and a NATS server and loses what
// is in flight as a server that dies does: silence drops every byte
// either way, die closes the connections (the client reconnects through
// it). A request sent in between is never answered. (libs/lease's tests
// have the same proxy; natstest is the place for one of them.)
type lossyProxy struct {
	l      net.Listener
	target string

	mu     sync.Mutex
	silent bool
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

func newLossyProxy(t *testing.T, target string) *lossyProxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &lossyProxy{l: l, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Go(func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", target)
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
	})
	t.Cleanup(func() {
		_ = l.Close()
		p.die()
		p.wg.Wait()
	})
	return p
}

func (p *lossyProxy) pipe(dst, src net.Conn) {
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
		if err != nil {
			break
		}
	}
	_ = dst.Close()
	_ = src.Close()
}

func (p *lossyProxy) silence() {
	p.mu.Lock()
	p.silent = true
	p.mu.Unlock()
}

func (p *lossyProxy) die() {
	p.mu.Lock()
	p.silent = false
	open := make([]net.Conn, 0, len(p.conns))
	for c := range p.conns {
		open = append(open, c)
	}
	clear(p.conns)
	p.mu.Unlock()
	for _, c := range open {
		_ = c.Close()
	}
}

// TestStreamLivesOutlivesALostAnswer: a new term's look at the snapshot
// streams, sent to a NATS server that dies before it answers, is sent
// again on the connection that comes back, instead of waiting for the
// term's context (CI's TestNATSNodeLossStopsNoRun: epoch 2 stuck in
// startSnapshots for a minute, no plan handled).
func TestStreamLivesOutlivesALostAnswer(t *testing.T) {
	srv := natstest.Start(t)
	u, err := url.Parse(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	p := newLossyProxy(t, u.Host)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a far deadline, as e2e's
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: "nats://" + p.l.Addr().String(), Name: "test",
		CredsFile: natstest.Service(t, srv, contracts.BusResourceManager)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	s := newServer(DefaultConfig(), b, slog.Default())

	p.silence()
	type result struct {
		n   int
		err error
	}
	done := make(chan result, 1)
	asked := time.Now()
	go func() {
		lives, err := s.streamLives(ctx)
		done <- result{len(lives), err}
	}()
	time.Sleep(200 * time.Millisecond) // the first look is sent into the silence
	p.die()

	limit := probeTimeout + 5*time.Second
	select {
	case r := <-done:
		if r.err != nil || r.n != len(snapshotStreams) {
			t.Fatalf("streamLives = %d streams, %v; want %d, nil", r.n, r.err, len(snapshotStreams))
		}
	case <-time.After(limit):
		t.Fatalf("streamLives still waiting %s after a lost answer", time.Since(asked).Round(time.Millisecond))
	}
}
