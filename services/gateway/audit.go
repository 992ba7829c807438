package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// The audit trail's writer. auditLog appends one contracts.AuditRecord per
// auditEvent to the AUDIT stream, on the hash chain that contracts/audit.go
// describes: every replica publishes with the stream's last sequence as the
// expected one and that message's hash as Prev, and reads the new tail
// after a conflict. Appends of one replica are serialized under a mutex,
// so a replica conflicts only with the others.

// auditTimeout bounds one record, conflicts and retries included: an
// unreachable bus must not hold a request for long.
const auditTimeout = 5 * time.Second

// auditAttempts bounds the compare-and-set retries of one record.
const auditAttempts = 20

// auditLog is the gateway's auditSink on the AUDIT stream.
type auditLog struct {
	bus *bus.Bus
	// gateway names this replica in every record it writes.
	gateway string
	log     *slog.Logger
	now     func() time.Time

	// stream is the AUDIT stream's handle, looked up once.
	stream atomic.Pointer[jetstream.Stream]
	// failing is set while the last record could not be written.
	failing atomic.Bool

	mu sync.Mutex
	// Lock should be held for the tail.
	tailKnown bool
	lastSeq   uint64
	lastHash  string
}

var _ auditSink = (*auditLog)(nil)

func newAuditLog(b *bus.Bus, gateway string, log *slog.Logger, now func() time.Time) *auditLog {
	return &auditLog{bus: b, gateway: gateway, log: log, now: now}
}

// record appends e. It returns nil when the record is in the stream, this
// time or before (a retried operation with the same key).
func (a *auditLog) record(ctx context.Context, e auditEvent) error {
	rec, keyed := buildAuditRecord(ctx, e, a.now())
	rec.Gateway = a.gateway
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), auditTimeout)
	defer cancel()
	if err := a.append(ctx, &rec, keyed); err != nil {
		a.failing.Store(true)
		return fmt.Errorf("audit %s %s: %w", rec.Action, rec.Outcome, err)
	}
	a.failing.Store(false)
	if st := auditRequestFrom(ctx); st != nil {
		st.markRecorded()
	}
	return nil
}

// ready reports whether the trail can take a record, before a state change
// is made: nil at once while the last record went in; after a failure, nil
// only once the chain's tail can be read again. So while the trail is down
// a change is refused before it is made, not only left unconfirmed after.
func (a *auditLog) ready(ctx context.Context) error {
	if !a.failing.Load() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, auditTimeout)
	defer cancel()
	stream, err := a.auditStream(ctx)
	if err == nil {
		a.mu.Lock()
		err = a.loadTailLocked(ctx, stream)
		a.mu.Unlock()
	}
	if err != nil {
		return fmt.Errorf("the audit trail is unavailable: %w", err)
	}
	a.failing.Store(false)
	return nil
}

// append publishes rec at the tail of the chain. A keyed record that the
// stream already holds is not written again: the duplicate window covers a
// retry within minutes, the look-up by subject any retry after. The
// look-up asks the stream's leader (bus.LeaderLast): a direct get may be
// answered by a replica that lags and does not hold the record yet.
func (a *auditLog) append(ctx context.Context, rec *contracts.AuditRecord, keyed bool) error {
	stream, err := a.auditStream(ctx)
	if err != nil {
		return err
	}
	subject := contracts.SubjectAudit(rec.Tenant, rec.ID)
	if keyed {
		seq, err := bus.LeaderLast(ctx, a.bus.Conn(), contracts.StreamAudit, []string{subject})
		switch {
		case err != nil:
			return fmt.Errorf("look up %s: %w", subject, err)
		case seq > 0:
			return nil
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	var last error
	for range auditAttempts {
		if !a.tailKnown {
			if err := a.loadTailLocked(ctx, stream); err != nil {
				return err
			}
		}
		rec.Prev = a.lastHash
		data, err := json.Marshal(rec)
		if err != nil {
			return err
		}
		ack, err := a.bus.PublishRaw(ctx, subject, rec.ID, data, bus.ExpectLastSeq(a.lastSeq),
			bus.CEType("io.gpuplane.audit.record.v1"), bus.CESubject(rec.Object))
		switch {
		case err == nil && ack.Duplicate:
			// Another replica (or an earlier try of ours whose ack was
			// lost) stored this record; the tail moved under us.
			a.tailKnown = false
			return nil
		case err == nil:
			a.lastSeq, a.lastHash = ack.Sequence, contracts.AuditHash(data)
			return nil
		case errors.Is(err, bus.ErrWrongLastSequence):
			a.tailKnown = false
			last = err
			continue
		default:
			a.tailKnown = false
			return err
		}
	}
	return fmt.Errorf("the chain kept moving after %d tries: %w", auditAttempts, last)
}

// auditStream returns the AUDIT stream's handle; the handle only names the
// stream, so it stays good when the stream is recreated.
func (a *auditLog) auditStream(ctx context.Context) (jetstream.Stream, error) {
	if s := a.stream.Load(); s != nil {
		return *s, nil
	}
	s, err := a.bus.JetStream().Stream(ctx, contracts.StreamAudit)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", contracts.StreamAudit, err)
	}
	a.stream.Store(&s)
	return s, nil
}

// loadTailLocked reads the sequence and hash of the stream's last message.
// Lock should be held.
func (a *auditLog) loadTailLocked(ctx context.Context, stream jetstream.Stream) error {
	info, err := stream.Info(ctx)
	if err != nil {
		return fmt.Errorf("stream %s info: %w", contracts.StreamAudit, err)
	}
	a.lastSeq, a.lastHash = 0, ""
	if info.State.Msgs > 0 {
		m, err := stream.GetMsg(ctx, info.State.LastSeq)
		if err != nil {
			return fmt.Errorf("read the chain's tail (seq %d): %w", info.State.LastSeq, err)
		}
		a.lastSeq, a.lastHash = m.Sequence, contracts.AuditHash(m.Data)
	}
	a.tailKnown = true
	return nil
}

// buildAuditRecord turns e into a record with what ctx tells: the
// principal (authentication's), the request's source, trace, path and
// status (auditRequests'). keyed says whether the record's ID is
// deterministic. Nothing secret goes in: no header, body or query.
func buildAuditRecord(ctx context.Context, e auditEvent, now time.Time) (contracts.AuditRecord, bool) {
	rec := contracts.AuditRecord{SchemaVersion: contracts.SchemaVersion, Time: e.At.UTC(), Actor: "anonymous",
		Action: e.Action, Object: clip(e.Object, 256), Outcome: contracts.AuditOutcome(e.Outcome),
		Reason: contracts.Reason(clip(e.Reason, 64))}
	if e.At.IsZero() {
		rec.Time = now.UTC()
	}
	st := auditRequestFrom(ctx)
	p, ok := principalFrom(ctx)
	if !ok && st != nil {
		p, ok = st.principalSeen()
	}
	if ok && p.Subject != "" {
		rec.Actor, rec.ActorName, rec.AuthMethod = clip(p.Subject, 512), clip(p.Name, 256), p.Method
		for _, b := range p.Roles {
			rec.Roles = append(rec.Roles, contracts.AuditRole{Role: b.Role, Tenant: b.Tenant})
		}
	}
	key := e.Key
	if st != nil {
		st.mu.Lock()
		rec.Source, rec.TraceID, rec.Request, rec.Status = st.source, st.traceID, st.request, st.status
		if rec.Action == "" {
			rec.Action = st.action
		}
		if key == "" && rec.Action == st.action {
			key = st.key
		}
		st.mu.Unlock()
	}
	if contracts.ValidateAuditAction(rec.Action) != nil {
		rec.Action = "request"
	}
	if !validOutcome(rec.Outcome) {
		rec.Outcome = contracts.AuditFailure
	}
	// The tenant is a subject token: a malformed one (from a path that
	// failed validation) is kept as text in the object, never as a token.
	rec.Tenant = e.Tenant
	if rec.Tenant != "" && contracts.ValidateTenant(rec.Tenant) != nil {
		rec.Object = clip(fmt.Sprintf("%s (tenant %q)", rec.Object, rec.Tenant), 256)
		rec.Tenant = ""
	}
	if key != "" {
		rec.ID = contracts.AuditRecordID(rec.Action, rec.Tenant, rec.Object, rec.Outcome, key)
		return rec, true
	}
	rec.ID = contracts.NewJobID()
	return rec, false
}

func validOutcome(o contracts.AuditOutcome) bool {
	for _, v := range contracts.AuditOutcomes {
		if o == v {
			return true
		}
	}
	return false
}

// clip bounds a string copied from a request into a record.
func clip(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// replicaName names this gateway replica in its records: the host and the
// address it listens on.
func replicaName(addr string) string {
	host, err := os.Hostname()
	if err != nil {
		host = "unknown-host"
	}
	return host + "/" + addr
}
