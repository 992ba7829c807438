package bus

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A read that ends where its consumer counts nothing left can end short of
// the stream. A consumer counts what its own server holds, and a direct get
// (the streams allow them, and nats.go's Stream.GetMsg and
// GetLastMsgForSubject then use it) is answered by any replica: on a
// cluster either may be a member that lags, one cut off by a partition
// while the others stored the last messages. The stream's leader, the only
// server that answers $JS.API.STREAM.MSG.GET of a replicated stream, holds
// every message acked to a publisher while it leads: a read asks it where
// the stream ends (LeaderLast, LeaderNext), and never trusts a consumer's
// count of 0 alone. This narrows the window, it does not close it: a
// leader cut off by a partition answers as leader until it learns it is
// not (seconds, in the chaos suite), no worse than a direct get did.
//
// The price is the leader's silence: a member that does not lead does not
// answer, so while a stream has no leader (an election, a member cut off
// from the others) a read waits, and retries, where a direct get answered
// at once; the callers' reads are bounded and end in an error then, never
// in a short answer. A 503 from the server (no leader for now) is a
// jetstream.APIError, which the bus's retries take as passing.

// leaderMsgGetSubject is the stream's leader's message get; nats.go's
// Stream.GetMsg uses the direct get on a stream that allows it.
const leaderMsgGetSubject = "$JS.API.STREAM.MSG.GET."

// msgGetRequest is the server's JSApiMsgGetRequest, the fields we send.
type msgGetRequest struct {
	Seq       uint64     `json:"seq,omitempty"`
	LastFor   string     `json:"last_by_subj,omitempty"`
	NextFor   string     `json:"next_by_subj,omitempty"`
	StartTime *time.Time `json:"start_time,omitempty"`
	NoHeaders bool       `json:"no_hdr,omitempty"`
}

type msgGetResponse struct {
	// Error is nats.go's own: callers (transient) tell a 503 (no leader
	// for now, an election) from a lasting refusal by it.
	Error   *jetstream.APIError `json:"error,omitempty"`
	Message *struct {
		Seq uint64 `json:"seq"`
	} `json:"message,omitempty"`
}

// leaderGet returns the sequence of the message of stream that req
// selects, as the stream's leader holds it: 0 when it holds none.
func leaderGet(ctx context.Context, nc *nats.Conn, stream string, req msgGetRequest) (uint64, error) {
	req.NoHeaders = true
	body, err := json.Marshal(req)
	if err != nil {
		return 0, err
	}
	reply, err := nc.RequestWithContext(ctx, leaderMsgGetSubject+stream, body)
	if err != nil {
		return 0, fmt.Errorf("asking the leader of %s: %w", stream, err)
	}
	var resp msgGetResponse
	if err := json.Unmarshal(reply.Data, &resp); err != nil {
		return 0, fmt.Errorf("asking the leader of %s: %w", stream, err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return 0, nil
	case resp.Error != nil:
		return 0, fmt.Errorf("asking the leader of %s: %w", stream, resp.Error)
	case resp.Message == nil:
		return 0, fmt.Errorf("asking the leader of %s: an answer without a message", stream)
	}
	return resp.Message.Seq, nil
}

// anySubject matches every subject of a stream.
const anySubject = ">"

// LeaderNext returns the sequence of the first message of stream matching
// one of subjects (none: any) at or after seq, or, when since is set, at or
// after the first message stored at or after since: 0 when there is none.
func LeaderNext(ctx context.Context, nc *nats.Conn, stream string, subjects []string, seq uint64, since time.Time) (uint64, error) {
	if len(subjects) == 0 {
		subjects = []string{anySubject}
	}
	var first uint64
	for _, s := range subjects {
		req := msgGetRequest{Seq: max(seq, 1), NextFor: s}
		if !since.IsZero() {
			req.Seq, req.StartTime = 0, &since
		}
		n, err := leaderGet(ctx, nc, stream, req)
		if err != nil {
			return 0, err
		}
		if n > 0 && (first == 0 || n < first) {
			first = n
		}
	}
	return first, nil
}

// LeaderLast returns the sequence of the last message of stream matching
// one of subjects (none: any): 0 when there is none.
func LeaderLast(ctx context.Context, nc *nats.Conn, stream string, subjects []string) (uint64, error) {
	if len(subjects) == 0 {
		subjects = []string{anySubject}
	}
	var last uint64
	for _, s := range subjects {
		n, err := leaderGet(ctx, nc, stream, msgGetRequest{LastFor: s})
		if err != nil {
			return 0, err
		}
		last = max(last, n)
	}
	return last, nil
}
