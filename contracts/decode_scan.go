package contracts

import (
	"bytes"
	"encoding/json"
	"io"
	"unicode/utf8"
)

// tokens is what checkDoc walks: json.Decoder's token stream, or
// validTokens over a document json.Valid accepted. Both hand out the same
// tokens (json.Delim, string, json.Number, bool, nil), skipping commas
// and colons, and More reports whether the enclosing object or array
// holds another element.
type tokens interface {
	Token() (json.Token, error)
	More() bool
}

// validTokens reads the tokens of a document known to be valid JSON.
//
// json.Decoder.Token costs most of a strict decode (BenchmarkDecodeJobRequest:
// 40 % of it, ~750 allocations a request): each scalar goes through a full
// Decode into an interface, and finding a value's end makes the scanner
// build and drop an error. A valid document needs none of that: a token's
// end is found by a byte scan, and only a string with an escape or a byte
// beyond ASCII goes through encoding/json, so that it unquotes exactly as
// the decoder would (invalid UTF-8 replaced, surrogate pairs joined). A
// document json.Valid refuses is walked by the decoder, whose syntax
// errors name the byte: what the caller reports stays the same
// (TestValidTokensAgreeWithDecoder, FuzzValidTokensAgreeWithDecoder).
type validTokens struct {
	data []byte
	pos  int
}

func (v *validTokens) skip() {
	for v.pos < len(v.data) {
		switch v.data[v.pos] {
		case ' ', '\t', '\n', '\r', ',', ':':
			v.pos++
		default:
			return
		}
	}
}

// More reports whether a value follows before the enclosing object or
// array closes (the element separator, if next, counts as one).
func (v *validTokens) More() bool {
	for v.pos < len(v.data) {
		switch v.data[v.pos] {
		case ' ', '\t', '\n', '\r':
			v.pos++
			continue
		}
		break
	}
	return v.pos < len(v.data) && v.data[v.pos] != ']' && v.data[v.pos] != '}'
}

// Token returns the next token, io.EOF after the document.
func (v *validTokens) Token() (json.Token, error) {
	v.skip()
	if v.pos >= len(v.data) {
		return nil, io.EOF
	}
	switch c := v.data[v.pos]; c {
	case '{', '}', '[', ']':
		v.pos++
		return json.Delim(c), nil
	case '"':
		return v.str()
	case 't':
		v.pos += len("true")
		return true, nil
	case 'f':
		v.pos += len("false")
		return false, nil
	case 'n':
		v.pos += len("null")
		return nil, nil
	}
	start := v.pos
	for v.pos < len(v.data) {
		switch v.data[v.pos] {
		case '-', '+', '.', 'e', 'E', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
			v.pos++
			continue
		}
		break
	}
	return json.Number(v.data[start:v.pos]), nil
}

// str reads the string that starts at pos.
func (v *validTokens) str() (json.Token, error) {
	start := v.pos
	plain := true
	i := start + 1
	for {
		j := bytes.IndexAny(v.data[i:], `"\`)
		i += j // a valid document closes every string
		if v.data[i] == '"' {
			break
		}
		plain = false
		i += 2 // the escape and the byte it escapes
	}
	v.pos = i + 1
	raw := v.data[start:v.pos]
	inner := raw[1 : len(raw)-1]
	if plain && utf8.Valid(inner) {
		return string(inner), nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return nil, err
	}
	return s, nil
}
