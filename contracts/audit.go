package contracts

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

// The audit trail. The gateway appends one AuditRecord to the AUDIT stream
// for every state-changing request it serves (whatever its outcome), every
// denial and every login, success or failure. The stream is evidence: it
// denies delete and purge, and its records form one hash chain in stream
// order, so a record altered, removed or forged in between is detected by
// AuditChain.
//
// One chain, one order. Every gateway replica appends to the same chain:
// it publishes with Nats-Expected-Last-Sequence set to the stream's last
// sequence as it knows it, and the record carries the hash of the message
// at that sequence in Prev. The server refuses the publish when another
// replica appended first; the writer then reads the new tail and tries
// again. A stream-wide compare-and-set (rather than a per-subject one on a
// single chain subject) lets records keep a subject per tenant, so a tenant
// admin's read is a subject filter, and costs nothing more: AUDIT holds
// nothing but the chain. A per-gateway chain would avoid the conflicts but
// would let a replica's whole chain vanish unnoticed with the replica.
//
// Exactly once. A record whose operation has a stable key (a job ID, an
// Idempotency-Key) gets a deterministic ID, AuditRecordID, which is both
// its Nats-Msg-Id (JetStream drops a retried publish inside the duplicate
// window) and the last token of its subject, so a writer can ask the
// stream whether the record exists (the last message of that subject) at
// any later time, outside the window too.

const (
	// SubjectAuditAll matches every audit record: gp.audit.<scope>.<record id>.
	SubjectAuditAll = "gp.audit.>"
	// AuditPlatformScope is the scope token of records about no tenant
	// (price book, pools, nodes, logins). Tenants match [a-z0-9-], so a
	// token starting with '_' can never be a tenant's.
	AuditPlatformScope = "_platform"
)

// AuditScope is the subject token of a record about tenant ("": the
// platform).
func AuditScope(tenant string) string {
	if tenant == "" {
		return AuditPlatformScope
	}
	return tenant
}

// SubjectAudit is the subject of one audit record.
func SubjectAudit(tenant, recordID string) string {
	return "gp.audit." + AuditScope(tenant) + "." + recordID
}

// SubjectAuditTenant matches every record of one tenant ("": the
// platform's).
func SubjectAuditTenant(tenant string) string { return "gp.audit." + AuditScope(tenant) + ".*" }

// AuditOutcome is what became of an audited operation.
type AuditOutcome string

const (
	// AuditSuccess: the operation was done (2xx).
	AuditSuccess AuditOutcome = "success"
	// AuditDenied: authentication or a role check refused it (401, 403).
	AuditDenied AuditOutcome = "denied"
	// AuditFailure: it was refused for another reason (invalid, conflict,
	// unavailable) or failed.
	AuditFailure AuditOutcome = "failure"
)

// AuditOutcomes lists every outcome, for validation and flags.
var AuditOutcomes = []AuditOutcome{AuditSuccess, AuditDenied, AuditFailure}

// AuditRole is one role binding in force when a record was made.
type AuditRole struct {
	Role   string `json:"role"`
	Tenant string `json:"tenant,omitempty"`
}

// AuditRecord is one entry of the audit trail, published on
// SubjectAudit(tenant, ID). It never carries a secret: no token, password,
// header or request body, only who, what, on what, and how it ended.
type AuditRecord struct {
	SchemaVersion int `json:"schema_version"`
	// ID is the record's ID and the last token of its subject:
	// AuditRecordID for a keyed operation, a fresh ULID otherwise.
	ID   string    `json:"id"`
	Time time.Time `json:"time"`
	// Actor is the authenticated subject ("oidc:<issuer>#<sub>",
	// "ldap:<dn>", "token:<id>"), or "anonymous" when there was none (a
	// failed login, a request without credentials).
	Actor string `json:"actor"`
	// ActorName is what a person reads (user name, token name).
	ActorName string `json:"actor_name,omitempty"`
	// AuthMethod is how the actor authenticated: oidc, ldap, token.
	AuthMethod string `json:"auth_method,omitempty"`
	// Roles are the actor's role bindings when the request was served.
	Roles []AuditRole `json:"roles,omitempty"`
	// Tenant the object belongs to; "" for platform objects.
	Tenant string `json:"tenant,omitempty"`
	// Action is a stable verb such as job.submit, quota.put, node.cordon,
	// login.
	Action string `json:"action"`
	// Object names what was acted on: a job ID, a node, a pool.
	Object  string       `json:"object,omitempty"`
	Outcome AuditOutcome `json:"outcome"`
	// Reason is the stable reason code of a denial or failure.
	Reason Reason `json:"reason,omitempty"`
	// Request is the HTTP method and path (no query: it may carry free text).
	Request string `json:"request,omitempty"`
	// Status is the HTTP status answered.
	Status int `json:"status,omitempty"`
	// Source is the client's address as the gateway saw it.
	Source string `json:"source,omitempty"`
	// TraceID is the W3C trace ID of the request, shared by the messages it
	// published.
	TraceID string `json:"trace_id,omitempty"`
	// Gateway is the replica that wrote the record.
	Gateway string `json:"gateway,omitempty"`
	// Prev is AuditHash of the message before this one in the AUDIT
	// stream; "" for the first record.
	Prev string `json:"prev"`
}

// AuditRecordID is the deterministic ID of the record of a keyed operation:
// the same action, tenant, object, outcome and key give the same ID, so a
// retried request is recorded once. A different outcome is another record
// (a denied attempt and a later successful one are two operations).
func AuditRecordID(action, tenant, object string, outcome AuditOutcome, key string) string {
	h := sha256.New()
	for _, s := range []string{action, tenant, object, string(outcome), key} {
		// Length-prefixed, so no two tuples encode alike.
		fmt.Fprintf(h, "%d:%s;", len(s), s)
	}
	return "k" + hex.EncodeToString(h.Sum(nil))[:40]
}

// AuditHash is the chain hash of one stored audit message: the hex SHA-256
// of its body exactly as stored. Hashing the stored bytes (not a
// re-encoding) lets any client verify the chain without our JSON encoder.
func AuditHash(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// AuditEntry is an audit record as the API answers it: the record, where
// it sits in the stream, and its chain hash.
type AuditEntry struct {
	AuditRecord
	Seq  uint64 `json:"seq"`
	Hash string `json:"hash"`
}

// AuditList is the answer of GET /v1/audit, oldest first. More is set when
// the limit cut the list; the next page starts after the last Seq.
type AuditList struct {
	Records []AuditEntry `json:"records"`
	More    bool         `json:"more,omitempty"`
}

// AuditBreak is one place where the chain does not hold.
type AuditBreak struct {
	Seq    uint64 `json:"seq"`
	ID     string `json:"id,omitempty"`
	Reason string `json:"reason"`
}

// AuditVerification is the answer of GET /v1/audit/verify.
type AuditVerification struct {
	// Records is how many records were checked.
	Records int `json:"records"`
	// LastSeq and LastHash name the tail: keep them elsewhere to detect a
	// tail cut off later, which a chain alone cannot show.
	LastSeq  uint64       `json:"last_seq"`
	LastHash string       `json:"last_hash"`
	OK       bool         `json:"ok"`
	Breaks   []AuditBreak `json:"breaks,omitempty"`
}

// AuditChain verifies the hash chain of the AUDIT stream one message at a
// time, in stream order, in constant memory. The zero value expects the
// stream's first message.
type AuditChain struct {
	prev    string
	prevSeq uint64
	n       int
}

// Next checks the message at stream sequence seq with body data, and
// returns a break when its body is not an audit record, or its Prev is not
// the hash of the message before it (a record before it was removed or
// altered, or it was forged). After a break, the chain continues from this
// message, so each break is reported once.
func (c *AuditChain) Next(seq uint64, data []byte) *AuditBreak {
	c.n++
	var rec struct {
		ID   string  `json:"id"`
		Prev *string `json:"prev"`
	}
	err := json.Unmarshal(data, &rec)
	prev, prevSeq := c.prev, c.prevSeq
	c.prev, c.prevSeq = AuditHash(data), seq
	switch {
	case err != nil:
		return &AuditBreak{Seq: seq, Reason: fmt.Sprintf("not an audit record: %v", err)}
	case rec.Prev == nil:
		return &AuditBreak{Seq: seq, ID: rec.ID, Reason: "no prev hash"}
	case *rec.Prev != prev && prevSeq == 0:
		return &AuditBreak{Seq: seq, ID: rec.ID, Reason: fmt.Sprintf("the first record checked names prev %s, want %q", short(*rec.Prev), prev)}
	case *rec.Prev != prev:
		return &AuditBreak{Seq: seq, ID: rec.ID, Reason: fmt.Sprintf(
			"prev %s is not the hash %s of seq %d: a record between them was removed, or seq %d was altered",
			short(*rec.Prev), short(prev), prevSeq, prevSeq)}
	}
	return nil
}

// Records is how many messages Next checked.
func (c *AuditChain) Records() int { return c.n }

// Tail is the sequence and hash of the last message checked.
func (c *AuditChain) Tail() (uint64, string) { return c.prevSeq, c.prev }

func short(h string) string {
	if len(h) > 12 {
		return h[:12]
	}
	if h == "" {
		return `""`
	}
	return h
}

// ValidateAuditAction reports whether s can be an action: lowercase dotted
// words ("job.submit").
func ValidateAuditAction(s string) error {
	if s == "" || len(s) > 64 || strings.Trim(s, "abcdefghijklmnopqrstuvwxyz0123456789._-") != "" {
		return fmt.Errorf("invalid audit action %q: want 1-64 of [a-z0-9._-]", s)
	}
	return nil
}
