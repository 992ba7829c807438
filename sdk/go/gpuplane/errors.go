package gpuplane

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// APIError is a refusal: the gateway's answer outside 2xx, with the stable
// reason code, message and field errors of its error body
// (contracts.APIError), or a request the caller refused before sending
// anything (StatusCode 0), presented the same way.
type APIError struct {
	// StatusCode is the HTTP status; 0 when nothing was sent.
	StatusCode int
	// Reason is the stable reason code (contracts.ReasonNotFound,
	// contracts.ReasonInvalidRequest, ...): test it, not Message. Empty
	// when the answer had no gateway error body (a proxy answered).
	Reason contracts.Reason
	// Message says what went wrong, for people.
	Message string
	// Fields are the field errors of a rejected document or query: which
	// field, its own reason code and message.
	Fields []contracts.FieldError
}

func (e *APIError) Error() string {
	switch {
	case e.StatusCode == 0: // found before sending anything
		return fmt.Sprintf("%s: %s", e.Reason, e.Message)
	case e.Reason == "":
		return fmt.Sprintf("HTTP %d: %s", e.StatusCode, e.Message)
	}
	return fmt.Sprintf("%s: %s (HTTP %d)", e.Reason, e.Message, e.StatusCode)
}

// Field is the field error on field, or nil.
func (e *APIError) Field(field string) *contracts.FieldError {
	for i := range e.Fields {
		if e.Fields[i].Field == field {
			return &e.Fields[i]
		}
	}
	return nil
}

// ValidationError presents a document refused by the caller's own check
// (a contracts.Decode... function) as the gateway would have answered it,
// so callers handle both alike; other errors are returned as they are.
func ValidationError(err error, message string) error {
	ve, ok := errors.AsType[*contracts.ValidationError](err)
	if !ok {
		return err
	}
	return &APIError{Reason: ve.Reason, Message: message, Fields: ve.Fields}
}

// answerError turns an error answer into an *APIError, whether or not its
// body is the gateway's error body (a proxy may answer instead).
func answerError(status int, data []byte) error {
	var ae contracts.APIError
	if err := json.Unmarshal(data, &ae); err == nil && ae.Error.Reason != "" {
		return &APIError{StatusCode: status, Reason: ae.Error.Reason, Message: ae.Error.Message, Fields: ae.Error.Fields}
	}
	msg := strings.TrimSpace(string(data))
	if len(msg) > 200 {
		msg = msg[:200] + "..."
	}
	if msg == "" {
		msg = http.StatusText(status)
	}
	return &APIError{StatusCode: status, Message: msg}
}

// AsAPIError is err's *APIError, if it has one.
func AsAPIError(err error) (*APIError, bool) { return errors.AsType[*APIError](err) }

// ReasonOf is the reason code of err's *APIError; "" when it has none.
func ReasonOf(err error) contracts.Reason {
	if ae, ok := AsAPIError(err); ok {
		return ae.Reason
	}
	return ""
}

func hasStatus(err error, status int) bool {
	ae, ok := AsAPIError(err)
	return ok && ae.StatusCode == status
}

// IsNotFound: no such job, node, token or path (404).
func IsNotFound(err error) bool { return hasStatus(err, http.StatusNotFound) }

// IsForbidden: the caller's roles do not allow it (403).
func IsForbidden(err error) bool { return hasStatus(err, http.StatusForbidden) }

// IsUnauthenticated: no credentials, or credentials the gateway refuses
// (401): log in again.
func IsUnauthenticated(err error) bool { return hasStatus(err, http.StatusUnauthorized) }

// IsConflict: the document changed since it was read (a revision
// precondition failed), or the job is not in a state that allows it (409).
func IsConflict(err error) bool { return hasStatus(err, http.StatusConflict) }

// IsInvalid: the request or its document was refused as invalid, by the
// gateway (400, 422) or before sending; Fields says which fields.
func IsInvalid(err error) bool {
	ae, ok := AsAPIError(err)
	return ok && (ae.StatusCode == http.StatusBadRequest || ae.StatusCode == http.StatusUnprocessableEntity ||
		ae.StatusCode == 0 && len(ae.Fields) > 0)
}

// IsRateLimited: the tenant sent too many requests (429), after retries.
func IsRateLimited(err error) bool { return hasStatus(err, http.StatusTooManyRequests) }

// IsUnavailable: the gateway cannot serve it now (503: the bus is
// unreachable, the read model is catching up), after retries.
func IsUnavailable(err error) bool { return hasStatus(err, http.StatusServiceUnavailable) }
