package contracts

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Reasons of the strict decoder (decodeStrict) beyond those of reasons.go.
const (
	// ReasonDuplicateField: an object names the same key twice.
	// encoding/json would keep the last one; a request that says two
	// things is refused instead.
	ReasonDuplicateField Reason = "duplicate_field"
	// ReasonUnsupportedMediaType: an HTTP body declared as something
	// other than application/json.
	ReasonUnsupportedMediaType Reason = "unsupported_media_type"
	// ReasonUnreadableDocument: a stored document (a KV value) does not
	// decode; the endpoint that owns it reports it and accepts a PUT that
	// replaces it.
	ReasonUnreadableDocument Reason = "unreadable_document"
)

// The strict decoder holds every request body to its published JSON
// Schema (schema/*.json, generated from the Go types by Schemas) before
// encoding/json sees it, because encoding/json is laxer than the schema in
// ways that matter for a request:
//
//   - keys match case-insensitively ("Count" sets count, "ID" sets id);
//   - a duplicated key is merged or the last one wins;
//   - null is taken as "absent" for any field;
//   - custom types (Duration, Money) take forms the schema does not allow
//     (a number where the schema says a duration string);
//   - a zero value written out (priority: "") cannot be told from an
//     absent field by Validate, though the schema's enum refuses it.
//
// checkDoc walks the token stream once against the schema and checks
// what the schema states about each value: exact property names
// (additionalProperties), duplicate keys, JSON types (null included),
// enums and patterns. Bounds, lengths and required fields stay with each
// type's Validate, which also applies the rules a schema cannot state
// (a field that must equal the subject's tenant, fields that exclude each
// other); decode_test.go checks with a generated corpus, against an
// independent JSON Schema validator, that the two together accept
// exactly what the published schema accepts.
//
// While it walks, checkDoc writes the document out again in canonical
// form: a whole number written as 1.0 or 1e2 is an integer to JSON
// Schema but not to encoding/json, so integers are rewritten as digits.

// schemaNode is the subset of JSON Schema that Schemas emits.
type schemaNode struct {
	Ref        string                 `json:"$ref"`
	Type       string                 `json:"type"`
	Properties map[string]*schemaNode `json:"properties"`
	// Additional is nil when the schema does not say (anything goes),
	// or a schema (false: nothing).
	Additional *schemaNode            `json:"-"`
	Items      *schemaNode            `json:"items"`
	Required   []string               `json:"required"`
	AnyOf      []*schemaNode          `json:"anyOf"`
	Enum       []json.RawMessage      `json:"enum"`
	Pattern    string                 `json:"pattern"`
	Format     string                 `json:"format"`
	Defs       map[string]*schemaNode `json:"$defs"`
	// never is the false schema.
	never bool
	// match matches Pattern (matcher: by hand or by regexp).
	match func(string) bool
	// enumStrings holds Enum when every member is a string.
	enumStrings map[string]bool
}

func (n *schemaNode) UnmarshalJSON(b []byte) error {
	switch string(bytes.TrimSpace(b)) {
	case "false":
		n.never = true
		return nil
	case "true":
		return nil
	}
	type plain schemaNode
	var p struct {
		plain
		Additional json.RawMessage `json:"additionalProperties"`
	}
	if err := json.Unmarshal(b, &p); err != nil {
		return err
	}
	*n = schemaNode(p.plain)
	if len(p.Additional) > 0 {
		n.Additional = &schemaNode{}
		if err := json.Unmarshal(p.Additional, n.Additional); err != nil {
			return err
		}
	}
	for _, m := range n.Enum {
		var str string
		if json.Unmarshal(m, &str) != nil {
			n.enumStrings = nil
			break
		}
		if n.enumStrings == nil {
			n.enumStrings = map[string]bool{}
		}
		n.enumStrings[str] = true
	}
	if n.Pattern != "" {
		m, err := matcher(n.Pattern)
		if err != nil {
			return fmt.Errorf("pattern %q: %w", n.Pattern, err)
		}
		n.match = m
	}
	return nil
}

// requestSchemas holds the parsed schema of every type in schemaTypes,
// by Go type, built once from the same reflection that writes the
// published files.
var requestSchemas = sync.OnceValues(func() (map[reflect.Type]*schemaNode, error) {
	docs, err := Schemas()
	if err != nil {
		return nil, err
	}
	out := make(map[reflect.Type]*schemaNode, len(schemaTypes))
	for name, v := range schemaTypes {
		var root schemaNode
		if err := json.Unmarshal(docs[name], &root); err != nil {
			return nil, fmt.Errorf("schema %s: %w", name, err)
		}
		resolveRefs(&root, root.Defs, map[*schemaNode]bool{})
		out[reflect.TypeOf(v)] = &root
	}
	return out, nil
})

// resolveRefs replaces every $ref by its definition (same pointer, so a
// recursive type stays finite).
func resolveRefs(n *schemaNode, defs map[string]*schemaNode, seen map[*schemaNode]bool) {
	if n == nil || seen[n] {
		return
	}
	seen[n] = true
	if n.Ref != "" {
		if d, ok := defs[strings.TrimPrefix(n.Ref, "#/$defs/")]; ok {
			resolveRefs(d, defs, seen)
			*n = *d
		}
	}
	for _, p := range n.Properties {
		resolveRefs(p, defs, seen)
	}
	resolveRefs(n.Additional, defs, seen)
	resolveRefs(n.Items, defs, seen)
	for _, b := range n.AnyOf {
		resolveRefs(b, defs, seen)
	}
}

// schemaFor returns the schema of v's type (v may be a pointer), or nil
// for a type without a published schema.
func schemaFor(v any) *schemaNode {
	all, err := requestSchemas()
	if err != nil {
		panic(fmt.Sprintf("contracts: request schemas: %v", err)) // a bug in this package; TestSchemasUpToDate catches it
	}
	t := reflect.TypeOf(v)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return all[t]
}

// CheckJSON holds data to the published schema of msg's type (msg is a
// value or pointer of a type listed in Schemas) and returns the document
// in canonical form, or a *ValidationError naming every value the schema
// refuses. Decoders outside this package (the gateway's fault request)
// call it before their own decoding.
func CheckJSON(data []byte, msg any) ([]byte, error) {
	if err := checkSize(data); err != nil {
		return nil, err
	}
	s := schemaFor(msg)
	if s == nil {
		return nil, fmt.Errorf("contracts: %T has no published schema", msg)
	}
	out, err := checkDoc(data, s)
	if soft, ok := err.(*softError); ok {
		return nil, soft.ValidationError
	}
	return out, err
}

func checkSize(data []byte) error {
	if len(data) > MaxMessageBytes {
		return newValidationError([]FieldError{{Reason: ReasonTooLarge,
			Message: fmt.Sprintf("body is %d bytes, limit is %d", len(data), MaxMessageBytes)}})
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return newValidationError([]FieldError{{Reason: ReasonEmptyBody, Message: "body is empty"}})
	}
	return nil
}

// idPattern is the schema pattern of IDs (ValidateID's): a value
// that fails it is reported as invalid_id.
const idPattern = `^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$`

// durationPattern is the schema pattern of a Duration: what
// time.ParseDuration reads, without a sign (no field takes a negative
// duration) and with at least one unit (a bare "30" is ambiguous).
const durationPattern = `^(0|(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+)$`

// errStop ends a walk whose token stream is broken.
var errStop = errors.New("stop")

type docChecker struct {
	dec  tokens
	out  bytes.Buffer
	errs []FieldError
	// syntax is the first syntax error; it replaces every other finding.
	syntax *FieldError
	// hard is set by a finding that keeps the document from being
	// decoded as it stands (a wrong type, an unknown or duplicated key, a
	// number too large, a malformed duration, amount or time); the others
	// (enum, pattern, missing field) leave it decodable, so Validate can
	// report its own findings beside them.
	hard bool
	// depth is how many objects and arrays enclose the current value.
	depth int
}

// checkDoc checks one JSON value (which must be an object, as every
// request is) against s; see the comment above schemaNode.
func checkDoc(data []byte, s *schemaNode) ([]byte, error) {
	valid := json.Valid(data)
	if valid {
		return checkTokens(data, s, &validTokens{data: data}, true)
	}
	return checkTokens(data, s, decoderTokens(data), false)
}

// decoderTokens is json.Decoder's token stream over data, numbers as
// json.Number.
func decoderTokens(data []byte) tokens {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	return dec
}

// checkTokens is checkDoc reading toks, the tokens of data; valid says
// whether json.Valid accepts data.
func checkTokens(data []byte, s *schemaNode, toks tokens, valid bool) ([]byte, error) {
	c := &docChecker{dec: toks}
	c.out.Grow(len(data))
	if first := bytes.TrimSpace(data)[0]; first != '{' && valid {
		kind := map[byte]string{'n': "null", '[': "an array", '"': "a string", 't': "a boolean", 'f': "a boolean"}[first]
		if kind == "" {
			kind = "a number"
		}
		return nil, newValidationError([]FieldError{{Reason: ReasonInvalidType,
			Message: fmt.Sprintf("the body must be a JSON object, not %s", kind)}})
	}
	err := c.value(s, "")
	if err == nil {
		if _, err2 := c.dec.Token(); !errors.Is(err2, io.EOF) {
			return nil, newValidationError([]FieldError{{Reason: ReasonInvalidJSON, Message: "trailing data after the JSON object"}})
		}
	}
	if c.syntax != nil {
		return nil, newValidationError([]FieldError{*c.syntax})
	}
	sortFieldErrors(c.errs) // by field, as Validate orders its own
	if len(c.errs) > MaxFieldErrors {
		more := len(c.errs) - MaxFieldErrors + 1
		c.errs = append(c.errs[:MaxFieldErrors-1], FieldError{Reason: c.errs[MaxFieldErrors-1].Reason,
			Message: fmt.Sprintf("and %d more problems", more)})
	}
	if err := newValidationError(c.errs); err != nil {
		if !c.hard {
			return c.out.Bytes(), &softError{err.(*ValidationError)}
		}
		return nil, err
	}
	return c.out.Bytes(), nil
}

// softError is what checkDoc found in a document that still decodes:
// values the schema refuses (enum, pattern, format) and missing fields.
type softError struct{ *ValidationError }

func (c *docChecker) token() (json.Token, error) {
	tok, err := c.dec.Token()
	if err != nil {
		fe := FieldError{Reason: ReasonInvalidJSON, Message: "unexpected end of JSON"}
		var syn *json.SyntaxError
		if errors.As(err, &syn) {
			fe.Message = fmt.Sprintf("%v at byte %d", syn, syn.Offset)
		} else if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
			fe.Message = err.Error()
		}
		c.syntax = &fe
		return nil, errStop
	}
	return tok, nil
}

func (c *docChecker) fail(path string, reason Reason, format string, args ...any) {
	c.errs = append(c.errs, FieldError{Field: path, Reason: reason, Message: fmt.Sprintf(format, args...)})
}

func (c *docChecker) failHard(path string, reason Reason, format string, args ...any) {
	c.hard = true
	c.fail(path, reason, format, args...)
}

func joinPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// jsonKind names the JSON type of a token for messages.
func jsonKind(tok json.Token) string {
	switch t := tok.(type) {
	case nil:
		return "null"
	case bool:
		return "boolean"
	case string:
		return "string"
	case json.Number:
		if _, ok := integerValue(t); ok {
			return "integer"
		}
		return "number"
	case json.Delim:
		if t == '{' {
			return "object"
		}
		return "array"
	}
	return "value"
}

// maxDepth bounds how deeply a document nests. Every request type is far
// shallower, so only values the schema refuses anyway reach it; it keeps
// a hostile [[[[...]]]] from costing a recursion per byte.
const maxDepth = 64

// value checks the next value against s (nil: anything) and copies it.
func (c *docChecker) value(s *schemaNode, path string) error {
	tok, err := c.token()
	if err != nil {
		return err
	}
	if d, ok := tok.(json.Delim); ok && (d == '{' || d == '[') {
		if c.depth++; c.depth > maxDepth {
			c.syntax = &FieldError{Field: path, Reason: ReasonInvalidJSON, Message: fmt.Sprintf("nested more than %d deep", maxDepth)}
			return errStop
		}
		defer func() { c.depth-- }()
	}
	if s == nil {
		s = &schemaNode{}
	}
	if s.never {
		c.failHard(path, ReasonUnknownField, "unknown field %q", lastKey(path))
		s = &schemaNode{}
	}
	money := false
	if len(s.AnyOf) > 0 {
		// Only Money has alternatives: a string or a number. The branch
		// of the token's type applies.
		var kinds []string
		var branch *schemaNode
		for _, b := range s.AnyOf {
			kinds = append(kinds, b.Type)
			money = money || b.Pattern == moneyPattern
			if branch == nil && typeMatches(b.Type, tok) {
				branch = b
			}
		}
		if branch == nil {
			c.failHard(path, ReasonInvalidType, "got JSON %s, want %s", jsonKind(tok), strings.Join(kinds, " or "))
			branch = &schemaNode{}
		}
		s = branch
	}
	if s.Type != "" && !typeMatches(s.Type, tok) {
		if s.Pattern == durationPattern {
			// A duration keeps its own reason whatever went wrong.
			c.failHard(path, ReasonInvalidDuration, `got JSON %s, want a duration string such as "30s" or "1h30m"`, jsonKind(tok))
		} else {
			c.failHard(path, ReasonInvalidType, "got JSON %s, want %s", jsonKind(tok), s.Type)
		}
		s = &schemaNode{} // keep walking for syntax and further fields
	}
	switch t := tok.(type) {
	case json.Delim:
		if t == '{' {
			return c.object(s, path)
		}
		return c.array(s, path)
	case nil:
		c.out.WriteString("null")
	case bool:
		c.out.WriteString(strconv.FormatBool(t))
	case string:
		c.checkString(s, path, t)
		writeString(&c.out, t)
	case json.Number:
		if money && !strings.ContainsAny(string(t), "eE") {
			c.out.WriteString(string(t)) // exactly as written: Money reads the digits
		} else if money {
			c.out.WriteString(moneyDigits(t))
		} else {
			c.checkNumber(s, path, t)
		}
	}
	c.checkEnum(s, path, tok)
	return nil
}

func lastKey(path string) string {
	if i := strings.LastIndexByte(path, '.'); i >= 0 {
		return path[i+1:]
	}
	return path
}

func typeMatches(want string, tok json.Token) bool {
	switch t := tok.(type) {
	case nil:
		return want == "null"
	case bool:
		return want == "boolean"
	case string:
		return want == "string"
	case json.Number:
		if want == "number" {
			return true
		}
		_, ok := integerValue(t)
		return want == "integer" && ok
	case json.Delim:
		return (t == '{' && want == "object") || (t == '[' && want == "array")
	}
	return false
}

// integerValue reports whether n is a whole number, as JSON Schema counts
// them (1.0 and 1e2 are integers), and returns it in digits; "" for a
// whole number too large to write out (beyond 1e30).
func integerValue(n json.Number) (string, bool) {
	s := string(n)
	if !strings.ContainsAny(s, ".eE") {
		return s, true
	}
	// Bound the work first: 1e999999 is whole, but must not become a
	// million digits (big.Rat would build them).
	if f, err := strconv.ParseFloat(s, 64); err != nil || math.Abs(f) > 1e30 {
		return "", err != nil || f == math.Trunc(f)
	}
	r, ok := new(big.Rat).SetString(s)
	if !ok || !r.IsInt() {
		return "", false
	}
	return r.Num().String(), true
}

// moneyDigits writes an amount given with an exponent (4.25e2) as plain
// decimals, which is what Money reads: JSON Schema counts it the same
// number. One with more than 6 decimals, or too large to be an amount,
// is left as it was, for Money to refuse.
func moneyDigits(n json.Number) string {
	if f, err := strconv.ParseFloat(string(n), 64); err != nil || math.Abs(f) > 1e13 {
		return string(n)
	}
	r, ok := new(big.Rat).SetString(string(n))
	if !ok || !new(big.Rat).Mul(r, big.NewRat(MicrosPerUnit, 1)).IsInt() {
		return string(n)
	}
	s := strings.TrimRight(r.FloatString(6), "0")
	return strings.TrimSuffix(s, ".")
}

func (c *docChecker) checkNumber(s *schemaNode, path string, n json.Number) {
	if s.Type == "integer" {
		digits, _ := integerValue(n)
		if _, err := strconv.ParseInt(digits, 10, 64); err != nil {
			c.failHard(path, ReasonOutOfRange, "%s does not fit a 64-bit integer", n)
			digits = "0"
		}
		c.out.WriteString(digits)
		return
	}
	if f, err := strconv.ParseFloat(string(n), 64); err != nil || math.IsInf(f, 0) {
		c.failHard(path, ReasonOutOfRange, "%s does not fit a 64-bit floating-point number", n)
	}
	c.out.WriteString(string(n))
}

func (c *docChecker) checkString(s *schemaNode, path, v string) {
	if s.match != nil && !s.match(v) {
		reason, what := ReasonInvalidValue, fmt.Sprintf("does not match the pattern %s", s.Pattern)
		switch {
		case s.Pattern == durationPattern:
			reason, what = ReasonInvalidDuration, `is not a duration such as "30s", "1h30m" or "0.5s" (no sign, no bare number)`
		case s.Pattern == idPattern:
			reason = ReasonInvalidID
		}
		if s.Pattern == durationPattern || s.Pattern == moneyPattern {
			c.hard = true // its UnmarshalJSON would fail without naming the field
		}
		c.fail(path, reason, "%q %s", truncate(v, 64), what)
	} else if s.Pattern == durationPattern {
		if _, err := time.ParseDuration(v); err != nil {
			c.failHard(path, ReasonOutOfRange, "%q is longer than the largest duration, %s", truncate(v, 64), time.Duration(math.MaxInt64))
		}
	}
	if s.Format == "date-time" {
		if _, err := time.Parse(time.RFC3339Nano, v); err != nil {
			c.failHard(path, ReasonInvalidValue, "%q is not an RFC 3339 time such as 2026-11-03T10:00:00Z", truncate(v, 64))
		}
	}
}

func (c *docChecker) checkEnum(s *schemaNode, path string, tok json.Token) {
	if len(s.Enum) == 0 {
		return
	}
	if str, ok := tok.(string); ok && s.enumStrings[str] {
		return
	}
	var got []byte
	switch t := tok.(type) {
	case string:
		got, _ = json.Marshal(t)
	case json.Number:
		got = []byte(t)
	case bool:
		got = []byte(strconv.FormatBool(t))
	case nil:
		got = []byte("null")
	default:
		got = nil
	}
	members := make([]string, len(s.Enum))
	for i, m := range s.Enum {
		members[i] = string(m)
		if got != nil && enumEqual(m, got) {
			return
		}
	}
	reason := ReasonInvalidValue
	switch lastKey(path) {
	case "priority":
		reason = ReasonUnknownPriority
	case "schemaVersion":
		reason = ReasonUnsupportedSchema
	}
	shown := string(got)
	if got == nil {
		shown = jsonKind(tok)
	}
	c.fail(path, reason, "%s is not one of %s", truncate(shown, 64), strings.Join(members, ", "))
}

// enumEqual compares JSON values as JSON Schema does (1 equals 1.0).
func enumEqual(member json.RawMessage, got []byte) bool {
	if bytes.Equal(member, got) {
		return true
	}
	a, okA := new(big.Rat).SetString(string(member))
	b, okB := new(big.Rat).SetString(string(got))
	return okA && okB && a.Cmp(b) == 0
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// writeString writes s to out as a JSON string, as marshalNoEscape does.
func writeString(out *bytes.Buffer, s string) {
	if plainString(s) { // the common case, without an encoder or a copy
		out.WriteByte('"')
		out.WriteString(s)
		out.WriteByte('"')
		return
	}
	b, _ := marshalNoEscape(s)
	out.Write(b)
}

// plainString reports whether s is printable ASCII with no quote or
// backslash: its JSON string is s quoted.
func plainString(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] >= 0x7f || s[i] == '"' || s[i] == '\\' {
			return false
		}
	}
	return true
}

// keySet is the keys an object named so far. Objects are small: a
// list until it grows, then a map, so a hostile object of thousands of
// keys costs no quadratic search.
type keySet struct {
	list []string
	m    map[string]bool
}

const keySetList = 32

// add adds k and reports whether it was new.
func (ks *keySet) add(k string) bool {
	if ks.has(k) {
		return false
	}
	if ks.m != nil {
		ks.m[k] = true
		return true
	}
	ks.list = append(ks.list, k)
	if len(ks.list) > keySetList {
		ks.m = make(map[string]bool, 2*len(ks.list))
		for _, k := range ks.list {
			ks.m[k] = true
		}
		ks.list = nil
	}
	return true
}

func (ks *keySet) has(k string) bool {
	if ks.m != nil {
		return ks.m[k]
	}
	return slices.Contains(ks.list, k)
}

func marshalNoEscape(s string) ([]byte, error) {
	if plainString(s) { // the common case, without an encoder
		return []byte(`"` + s + `"`), nil
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(s); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

func (c *docChecker) object(s *schemaNode, path string) error {
	c.out.WriteByte('{')
	var seen keySet
	for i := 0; c.dec.More(); i++ {
		tok, err := c.token()
		if err != nil {
			return err
		}
		key, _ := tok.(string)
		child, known := s.Properties[key]
		if !known {
			switch {
			case s.Additional != nil && !s.Additional.never:
				child = s.Additional
			case s.Additional != nil:
				child = &schemaNode{never: true}
				if other := caseFold(s.Properties, key); other != "" {
					child = nil
					c.failHard(joinPath(path, key), ReasonUnknownField, "unknown field %q (field names are case-sensitive: did you mean %q?)", key, other)
				}
			}
		}
		if !seen.add(key) {
			c.failHard(joinPath(path, key), ReasonDuplicateField, "field %q appears more than once", key)
		}
		if i > 0 {
			c.out.WriteByte(',')
		}
		writeString(&c.out, key)
		c.out.WriteByte(':')
		if err := c.value(child, joinPath(path, key)); err != nil {
			return err
		}
	}
	if _, err := c.token(); err != nil { // '}'
		return err
	}
	c.out.WriteByte('}')
	for _, r := range s.Required {
		if !seen.has(r) {
			c.fail(joinPath(path, r), ReasonMissingField, "%s is required", joinPath(path, r))
		}
	}
	return nil
}

func caseFold(props map[string]*schemaNode, key string) string {
	for _, k := range slices.Sorted(mapKeys(props)) {
		if strings.EqualFold(k, key) {
			return k
		}
	}
	return ""
}

func mapKeys(m map[string]*schemaNode) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

func (c *docChecker) array(s *schemaNode, path string) error {
	c.out.WriteByte('[')
	for i := 0; c.dec.More(); i++ {
		if i > 0 {
			c.out.WriteByte(',')
		}
		if err := c.value(s.Items, path+"["+strconv.Itoa(i)+"]"); err != nil {
			return err
		}
	}
	if _, err := c.token(); err != nil { // ']'
		return err
	}
	c.out.WriteByte(']')
	return nil
}

// decodeStrict decodes one JSON object into v, which must be a pointer to
// a type with a published schema, and returns every problem as a
// *ValidationError: the document is first held to the schema (checkDoc),
// then decoded, refusing unknown fields and trailing data, with decoder
// errors mapped to field errors.
func decodeStrict(data []byte, v any) error {
	soft, err := decodeSchema(data, v)
	if err != nil {
		return err
	}
	if soft != nil {
		return soft.ValidationError
	}
	return nil
}

// decodeValidated is decodeStrict followed by validate, reporting every
// problem at once: when the schema's findings leave the document
// decodable, Validate runs as well, and for a field both report, its
// finding (the more specific reason) is kept.
func decodeValidated(data []byte, v any, validate func() error) error {
	soft, err := decodeSchema(data, v)
	if err != nil {
		return err
	}
	verr := validate()
	if soft == nil {
		return verr
	}
	var fields []FieldError
	if ve, ok := verr.(*ValidationError); ok {
		fields = slices.Clone(ve.Fields)
	} else if verr != nil {
		return verr
	}
	for _, f := range soft.Fields {
		if !slices.ContainsFunc(fields, func(e FieldError) bool { return e.Field == f.Field }) {
			fields = append(fields, f)
		}
	}
	sortFieldErrors(fields)
	if len(fields) > MaxFieldErrors {
		more := len(fields) - MaxFieldErrors + 1
		fields = append(fields[:MaxFieldErrors-1], FieldError{Reason: fields[MaxFieldErrors-1].Reason,
			Message: fmt.Sprintf("and %d more problems", more)})
	}
	return newValidationError(fields)
}

// decodeSchema decodes data into v after checkDoc; a document that has
// only soft findings is decoded and they come back as soft.
func decodeSchema(data []byte, v any) (*softError, error) {
	if err := checkSize(data); err != nil {
		return nil, err
	}
	var soft *softError
	if s := schemaFor(v); s != nil {
		canon, err := checkDoc(data, s)
		if errors.As(err, &soft) {
			err = nil
		}
		if err != nil {
			return nil, err
		}
		data = canon
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return nil, newValidationError([]FieldError{decodeFieldError(err)})
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, newValidationError([]FieldError{{Reason: ReasonInvalidJSON, Message: "trailing data after the JSON object"}})
	}
	return soft, nil
}
