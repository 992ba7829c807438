package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// GET /v1/audit reads the trail, oldest first: a platform admin reads every
// record, a tenant admin the records of its tenants. Filters: tenant,
// actor (subject or name), action (exact, or "job.*" for a prefix),
// outcome, since and until (RFC 3339, or a duration back from now: "1h"),
// after (a stream sequence: the next page) and limit (1-1000, default 100).
// GET /v1/audit/verify walks the whole chain (platform admins only).

// Paging of GET /v1/audit.
const (
	defaultAuditLimit = 100
	maxAuditLimit     = 1000
	// maxAuditBreaks bounds the breaks one verification lists.
	maxAuditBreaks = 100
	// auditReadTimeout bounds one read of the stream.
	auditReadTimeout = 30 * time.Second
)

// auditQuery is a parsed GET /v1/audit.
type auditQuery struct {
	tenant, actor, action string
	outcome               contracts.AuditOutcome
	since, until          time.Time
	after                 uint64
	limit                 int
}

func parseAuditQuery(v url.Values, now time.Time) (auditQuery, []contracts.FieldError) {
	q := auditQuery{tenant: v.Get("tenant"), actor: v.Get("actor"), action: v.Get("action"), limit: defaultAuditLimit}
	var fields []contracts.FieldError
	bad := func(field, format string, args ...any) {
		fields = append(fields, contracts.FieldError{Field: field, Reason: contracts.ReasonInvalidValue, Message: fmt.Sprintf(format, args...)})
	}
	if q.tenant != "" && q.tenant != contracts.AuditPlatformScope && contracts.ValidateTenant(q.tenant) != nil {
		bad("tenant", "%v (or %s for the platform's records)", contracts.ValidateTenant(q.tenant), contracts.AuditPlatformScope)
	}
	if q.action != "" && contracts.ValidateAuditAction(strings.TrimSuffix(q.action, "*")) != nil {
		bad("action", "action %q: want a verb such as job.submit, or a prefix such as job.*", q.action)
	}
	if o := v.Get("outcome"); o != "" {
		q.outcome = contracts.AuditOutcome(o)
		if !validOutcome(q.outcome) {
			bad("outcome", "outcome %q: want one of %v", o, contracts.AuditOutcomes)
		}
	}
	for _, t := range []struct {
		name string
		dst  *time.Time
	}{{"since", &q.since}, {"until", &q.until}} {
		s := v.Get(t.name)
		if s == "" {
			continue
		}
		if at, err := time.Parse(time.RFC3339Nano, s); err == nil {
			*t.dst = at
		} else if d, err := time.ParseDuration(s); err == nil && d >= 0 {
			*t.dst = now.Add(-d)
		} else {
			bad(t.name, "%s %q: want an RFC 3339 time or a duration back from now such as 1h", t.name, s)
		}
	}
	if s := v.Get("after"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			bad("after", "after %q: want a stream sequence", s)
		}
		q.after = n
	}
	if s := v.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > maxAuditLimit {
			bad("limit", "limit %q: want 1 to %d", s, maxAuditLimit)
		}
		q.limit = n
	}
	return q, fields
}

// matches applies the filters the subject filter does not.
func (q auditQuery) matches(rec contracts.AuditRecord) bool {
	switch {
	case q.actor != "" && rec.Actor != q.actor && rec.ActorName != q.actor:
		return false
	case q.action != "" && !strings.HasSuffix(q.action, "*") && rec.Action != q.action:
		return false
	case strings.HasSuffix(q.action, "*") && !strings.HasPrefix(rec.Action, strings.TrimSuffix(q.action, "*")):
		return false
	case q.outcome != "" && rec.Outcome != q.outcome:
		return false
	case !q.since.IsZero() && rec.Time.Before(q.since):
		return false
	case !q.until.IsZero() && !rec.Time.Before(q.until):
		return false
	}
	return true
}

// listAudit answers GET /v1/audit.
func (s *server) listAudit(w http.ResponseWriter, r *http.Request) {
	q, fields := parseAuditQuery(r.URL.Query(), s.now())
	if len(fields) > 0 {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, "invalid query parameters", fields)
		return
	}
	filters, ok := s.auditFilters(w, r, q.tenant)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), auditReadTimeout)
	defer cancel()
	list := contracts.AuditList{Records: []contracts.AuditEntry{}}
	err := s.readAudit(ctx, filters, q.after+1, q.since, func(seq uint64, data []byte) bool {
		var rec contracts.AuditRecord
		if err := json.Unmarshal(data, &rec); err != nil {
			s.log.Warn("audit record unreadable; GET /v1/audit/verify reports it", "stream_seq", seq, "err", err)
			return true
		}
		if !q.until.IsZero() && !rec.Time.Before(q.until) {
			return false // records are in time order, give or take clock skew between replicas
		}
		if !q.matches(rec) {
			return true
		}
		if len(list.Records) == q.limit {
			list.More = true
			return false
		}
		list.Records = append(list.Records, contracts.AuditEntry{AuditRecord: rec, Seq: seq, Hash: contracts.AuditHash(data)})
		return true
	})
	if err != nil {
		s.internalError(w, "reading the audit trail", err)
		return
	}
	writeJSON(w, http.StatusOK, list)
}

// auditFilters returns the subject filters the caller may read (nil: the
// whole stream), or answers 403 and returns false.
func (s *server) auditFilters(w http.ResponseWriter, r *http.Request, tenant string) ([]string, bool) {
	p, _ := principalFrom(r.Context())
	all, tenants := auditReadScope(p)
	if tenant == contracts.AuditPlatformScope {
		tenant = ""
		if !all {
			s.forbid(w, r, "audit.read", "", contracts.AuditPlatformScope, "the platform's audit records are for platform admins")
			return nil, false
		}
		return []string{contracts.SubjectAuditTenant("")}, true
	}
	switch {
	case all && tenant == "":
		return nil, true
	case all, slices.Contains(tenants, tenant):
		return []string{contracts.SubjectAuditTenant(tenant)}, true
	case tenant == "" && len(tenants) > 0:
		filters := make([]string, 0, len(tenants))
		for _, t := range tenants {
			filters = append(filters, contracts.SubjectAuditTenant(t))
		}
		return filters, true
	case tenant != "":
		s.forbid(w, r, "audit.read", tenant, tenant, fmt.Sprintf("reading the audit trail of tenant %s needs role %s on it", tenant, RoleTenantAdmin))
	default:
		s.forbid(w, r, "audit.read", "", "", fmt.Sprintf("reading the audit trail needs role %s, or %s on a tenant", RolePlatformAdmin, RoleTenantAdmin))
	}
	return nil, false
}

// verifyAudit answers GET /v1/audit/verify: the chain checked from the
// first record to the last.
func (s *server) verifyAudit(w http.ResponseWriter, r *http.Request) {
	p, _ := principalFrom(r.Context())
	if all, _ := auditReadScope(p); !all {
		s.forbid(w, r, "audit.verify", "", "", fmt.Sprintf("verifying the audit trail needs role %s", RolePlatformAdmin))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), auditReadTimeout)
	defer cancel()
	var chain contracts.AuditChain
	var breaks []contracts.AuditBreak
	err := s.readAudit(ctx, nil, 1, time.Time{}, func(seq uint64, data []byte) bool {
		if b := chain.Next(seq, data); b != nil && len(breaks) < maxAuditBreaks {
			breaks = append(breaks, *b)
		}
		return true
	})
	if err != nil {
		s.internalError(w, "reading the audit trail", err)
		return
	}
	lastSeq, lastHash := chain.Tail()
	writeJSON(w, http.StatusOK, contracts.AuditVerification{Records: chain.Records(), LastSeq: lastSeq, LastHash: lastHash,
		OK: len(breaks) == 0, Breaks: breaks})
}

// readAudit calls fn for each message of AUDIT matching filters (nil: all)
// from sequence startSeq (or the first at or after since), in stream order,
// until fn returns false or the messages present at the start are read.
func (s *server) readAudit(ctx context.Context, filters []string, startSeq uint64, since time.Time,
	fn func(seq uint64, data []byte) bool) error {
	return readAuditTrail(ctx, s.bus.JetStream(), s.bus.Conn(), auditRange{filters: filters, startSeq: startSeq, since: since}, fn)
}

// auditRange is what one read of the trail reads: the messages matching
// filters (nil: all) from startSeq, or from the first stored at or after
// since when startSeq <= 1.
type auditRange struct {
	filters  []string
	startSeq uint64
	since    time.Time
}

// readAuditTrail is readAudit on js, asking nc's stream leader where the
// trail ends (bus.LeaderLast). The end is the last matching message when the
// read starts, as the leader holds it; the ordered consumer's count, its
// own server's, may be short of it on a cluster (a member that lags), so a
// count of 0 before the end ends the read only when the leader holds no
// matching message past it either: else the read goes on, and ends with
// an error at ctx's deadline, never with a short answer that looks whole.
func readAuditTrail(ctx context.Context, js jetstream.JetStream, nc *nats.Conn, r auditRange,
	fn func(seq uint64, data []byte) bool) error {
	end, err := bus.LeaderLast(ctx, nc, contracts.StreamAudit, r.filters)
	if err != nil {
		return fmt.Errorf("end of %s: %w", contracts.StreamAudit, err)
	}
	var since time.Time
	if r.startSeq <= 1 {
		since = r.since
	}
	first, err := bus.LeaderNext(ctx, nc, contracts.StreamAudit, r.filters, r.startSeq, since)
	if err != nil {
		return fmt.Errorf("start of %s: %w", contracts.StreamAudit, err)
	}
	if first == 0 || first > end {
		return nil
	}
	cons, err := js.OrderedConsumer(ctx, contracts.StreamAudit, jetstream.OrderedConsumerConfig{FilterSubjects: r.filters,
		InactiveThreshold: 30 * time.Second, DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: first})
	if err != nil {
		return fmt.Errorf("ordered consumer on %s: %w", contracts.StreamAudit, err)
	}
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("read %s: %w", contracts.StreamAudit, err)
	}
	defer it.Stop()
	last := first - 1
	for {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("read %s: stopped after %d, short of %d, the last record when the read began: %w",
					contracts.StreamAudit, last, end, ctx.Err())
			}
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return fmt.Errorf("read %s: %w", contracts.StreamAudit, err)
			}
			continue // the ordered consumer resets itself on gaps
		}
		meta, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("read %s: %w", contracts.StreamAudit, err)
		}
		last = meta.Sequence.Stream
		if !fn(last, m.Data()) || last >= end {
			return nil
		}
		if meta.NumPending > 0 {
			continue
		}
		// The consumer's server counts nothing past here, short of the
		// end: it lags, or the records up to the end are gone.
		next, err := bus.LeaderNext(ctx, nc, contracts.StreamAudit, r.filters, last+1, time.Time{})
		if err != nil {
			return fmt.Errorf("read %s: %w", contracts.StreamAudit, err)
		}
		if next == 0 || next > end {
			return nil
		}
	}
}
