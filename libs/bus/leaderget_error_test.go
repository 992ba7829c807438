package bus

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// TestLeaderErrorsAreTheAPIsErrors: the leader's answers with an error are
// told apart as nats.go's are. A 503 (no leader for now: an election, a
// member cut off) is retried as passing; "no message" is 0; a lasting
// refusal is not retried. (From a review: a 503 became a plain string, and
// a rebuild's Replay failed at once during a failover.) The answers are
// the server's own bodies, from a responder on the leader's subject: a
// stream without a leader cannot be had on demand.
func TestLeaderErrorsAreTheAPIsErrors(t *testing.T) {
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1})
	if err != nil {
		t.Fatal(err)
	}
	go s.Start()
	defer s.Shutdown()
	if !s.ReadyForConnections(5 * time.Second) {
		t.Fatal("nats-server not ready")
	}
	nc, err := nats.Connect(s.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	for _, c := range []struct {
		name, body string
		want       uint64
		fails      bool
		transient  bool
	}{
		{"no leader for now", `{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}`,
			0, true, true},
		{"no message", `{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","error":{"code":404,"err_code":10037,"description":"no message found"}}`,
			0, false, false},
		{"no stream", `{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","error":{"code":404,"err_code":10059,"description":"stream not found"}}`,
			0, true, false},
		{"a message", `{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","message":{"subject":"a.b","seq":42,"time":"2026-11-28T00:00:00Z"}}`,
			42, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			sub, err := nc.Subscribe(leaderMsgGetSubject+"S", func(m *nats.Msg) { _ = m.Respond([]byte(c.body)) })
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = sub.Unsubscribe() }()
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			got, err := LeaderLast(ctx, nc, "S", []string{"a.>"})
			if got != c.want || (err != nil) != c.fails || (err != nil && transient(err) != c.transient) {
				t.Errorf("LeaderLast = %d, %v (transient %v); want %d, failing %v, transient %v",
					got, err, err != nil && transient(err), c.want, c.fails, c.transient)
			}
		})
	}
}
