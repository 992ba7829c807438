package contracts

import (
	"bytes"
	"encoding/json"
)

// InvalidTenantToken stands for the tenant of a request whose subject names
// no valid tenant (gp.jobs.submit.ACME, a token of 40 characters, or the
// literal gp.jobs.submit.* or gp.jobs.submit.>, which JOBS stores like any
// other token). Such a request cannot be answered on its tenant's events,
// so the scheduler answers it on SubjectJobEvents(InvalidTenantToken,
// RejectedJobID(seq)), seq being the JOBS sequence of its PubAck. No tenant
// can be called this: tenants are [a-z0-9-].
const InvalidTenantToken = "_invalid"

// RejectedSubject is where the rejection of the request stored at JOBS
// sequence seq on a subject naming no valid tenant is published.
func RejectedSubject(seq uint64) string {
	return SubjectJobEvents(InvalidTenantToken, RejectedJobID(seq))
}

// topLevelID returns the value of the document's "id" key when it names
// exactly one string (exact case), for a request that does not decode:
// its rejection then goes to the job's own subject (FLOWS.md).
func topLevelID(data []byte) string {
	if len(data) > MaxMessageBytes {
		return "" // not read at all
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return ""
	}
	var id string
	found := 0
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return ""
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return ""
		}
		if key == "id" {
			found++
			if json.Unmarshal(v, &id) != nil {
				return ""
			}
		}
	}
	if found != 1 {
		return ""
	}
	return id
}

// WithJobID returns a job request body that lacks a top-level "id" with
// one added (the gateway names a job its client did not), or false when
// data is not a JSON object. The result is decoded again like any body:
// nothing else in it changes.
func WithJobID(data []byte, id string) ([]byte, bool) {
	body := bytes.TrimSpace(data)
	if len(body) < 2 || body[0] != '{' {
		return nil, false
	}
	field, _ := json.Marshal(id)
	out := append([]byte(`{"id":`), field...)
	rest := bytes.TrimSpace(body[1:])
	if len(rest) > 0 && rest[0] != '}' {
		out = append(out, ',')
	}
	return append(out, rest...), true
}
