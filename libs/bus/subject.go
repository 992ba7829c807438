package bus

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// SubjectMsgs calls fn with each message of subject in stream, in stream
// order from the first, until fn returns true or none is left. It reads
// with direct gets, the next message of the subject each: no consumer,
// which suits a few messages of one subject read now and then (a job's
// events, asked for by ID); a consumer per read would pile up on a
// stream every service shares. A subject with no message costs one get.
// A replica behind the stream's leader may answer a get.
func (b *Bus) SubjectMsgs(ctx context.Context, stream, subject string, fn func(*Msg) (stop bool)) error {
	s, err := b.streamHandle(ctx, stream)
	if err != nil {
		return err
	}
	for seq := uint64(1); ; {
		raw, err := s.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(subject))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s from %s seq %d: %w", subject, stream, seq, err)
		}
		if fn(&Msg{Stream: stream, Subject: raw.Subject, StreamSeq: raw.Sequence, Data: raw.Data, Header: raw.Header}) {
			return nil
		}
		seq = raw.Sequence + 1
	}
}

// streamHandle is stream's handle, looked up once: a handle only names
// its stream, so it stays good when the stream is recreated.
func (b *Bus) streamHandle(ctx context.Context, stream string) (jetstream.Stream, error) {
	if s, ok := b.streams.Load(stream); ok {
		return s.(jetstream.Stream), nil
	}
	s, err := b.js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", stream, err)
	}
	b.streams.Store(stream, s)
	return s, nil
}
