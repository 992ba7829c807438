package resourcemanager

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// At 10,000 machines the heartbeat feed carries 5,000 heartbeats a second
// (issue 17), and liveness reads one field of each: the incarnation.
// Decoding a whole contracts.Heartbeat (its node, time and every running
// allocation's ID) cost about 20 µs here, a partial decode with
// encoding/json still 12 µs (it scans and validates the whole body);
// heartbeatIncarnation reads the one field straight from the bytes the
// agent's encoding/json wrote, and leaves anything else to encoding/json.

// heartbeatLiveness is the part of a contracts.Heartbeat liveness reads.
type heartbeatLiveness struct {
	Incarnation string `json:"incarnation"`
}

// incarnationKey is how encoding/json writes the field.
var incarnationKey = []byte(`"incarnation":"`)

// heartbeatIncarnation returns a heartbeat's incarnation. The fast path
// takes a flat JSON object (no '{' past the first byte, so no nested
// object) in which the key "incarnation", right after '{' or ',', appears
// once with a plain string value (no escape). A quote inside a JSON string
// is always escaped, so those bytes cannot be part of another string.
// Any other body (escapes, a brace in a value, a duplicate key, spaces
// around the colon) is decoded by encoding/json, which also refuses what
// is not JSON. What the fast path does not do: validate the rest of the
// body (a heartbeat is a sign of life, and its sender is the node's own
// agent, by the subject's permissions), and match the key without regard
// to case as encoding/json does (a body with "Incarnation" alone goes to
// encoding/json; one with both spellings, which no agent writes, is read
// by the lower-case one).
func heartbeatIncarnation(data []byte) (string, error) {
	body := bytes.TrimSpace(data)
	if len(body) >= 2 && body[0] == '{' && body[len(body)-1] == '}' && bytes.IndexByte(body[1:], '{') < 0 {
		if i := bytes.Index(body, incarnationKey); i > 0 && (body[i-1] == '{' || body[i-1] == ',') {
			rest := body[i+len(incarnationKey):]
			if end := bytes.IndexByte(rest, '"'); end >= 0 && bytes.IndexByte(rest[:end], '\\') < 0 &&
				bytes.Count(body, incarnationKey[:len(incarnationKey)-2]) == 1 {
				return string(rest[:end]), nil
			}
		}
	}
	var hb heartbeatLiveness
	if err := json.Unmarshal(data, &hb); err != nil {
		return "", fmt.Errorf("decode heartbeat: %w", err)
	}
	return hb.Incarnation, nil
}
