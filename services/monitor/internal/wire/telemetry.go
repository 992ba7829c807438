// Package wire decodes the monitor's hottest message, a node agent's
// telemetry batch (contracts.Telemetry), faster than encoding/json, without
// changing the wire format.
//
// encoding/json spends most of its time on reflection and on checking the
// whole input before decoding it. A batch is written by our own agents with
// encoding/json, so its keys come in the exact case of the struct tags, once
// each, and its strings are plain. The fast path decodes exactly that subset
// in one pass and hands anything else to encoding/json:
//
//	data ──> fast path (one pass, checks the syntax it walks) ──> Telemetry
//	          │ a key that is not one of ours in exact case but matches one
//	          │ case-insensitively, a key seen twice, an escaped or non-ASCII
//	          │ key, a string with escapes or control bytes, a number a field
//	          │ cannot hold, a null where a value was expected, bad syntax
//	          └──> encoding/json.Unmarshal into a fresh value (its result and
//	               its error, verbatim)
//
// So the result is always the one encoding/json gives for the same bytes
// (FuzzDecodeTelemetry checks it), and invalid input gets encoding/json's
// error, wrapped. Unknown keys in the plain form are skipped on the fast
// path, so a newer agent's extra fields keep it fast.
package wire

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/gpuplane/gpuplane/contracts"
)

// DecodeTelemetry decodes a telemetry batch as encoding/json.Unmarshal
// would into a zero contracts.Telemetry.
func DecodeTelemetry(data []byte) (contracts.Telemetry, error) {
	return (*Decoder)(nil).Decode(data)
}

// Decoder decodes telemetry batches and shares the strings that repeat from
// one batch to the next (GPU UUIDs, models, allocation IDs, node names), so
// a steady fleet costs no string allocation. Its zero value is ready; it
// is not safe for concurrent use (one per follower).
type Decoder struct {
	interned map[string]string
}

// maxInterned bounds the shared strings: the table is dropped and started
// again when full, so churning allocation IDs cannot grow it without end.
const maxInterned = 1 << 16

// Decode decodes a telemetry batch as encoding/json.Unmarshal would into a
// zero contracts.Telemetry. A nil *Decoder decodes without sharing strings.
func (dec *Decoder) Decode(data []byte) (contracts.Telemetry, error) {
	var t contracts.Telemetry
	d := decoder{data: data, dec: dec}
	if d.telemetry(&t) {
		return t, nil
	}
	t = contracts.Telemetry{}
	if err := json.Unmarshal(data, &t); err != nil {
		return contracts.Telemetry{}, fmt.Errorf("telemetry batch: %w", err)
	}
	return t, nil
}

func (dec *Decoder) str(b []byte) string {
	if dec == nil {
		return string(b)
	}
	if s, ok := dec.interned[string(b)]; ok {
		return s
	}
	if dec.interned == nil || len(dec.interned) >= maxInterned {
		dec.interned = make(map[string]string, 1024)
	}
	s := string(b)
	dec.interned[s] = s
	return s
}

// decoder walks data once. Every method returns false as soon as the input
// leaves the subset the fast path handles; the caller then falls back.
type decoder struct {
	data []byte
	pos  int
	dec  *Decoder
	// depth bounds the recursion of skip, far below encoding/json's own
	// limit (10,000), so deep input falls back instead of growing the stack.
	depth int
}

const maxSkipDepth = 512

func (d *decoder) ws() {
	for d.pos < len(d.data) {
		switch d.data[d.pos] {
		case ' ', '\t', '\n', '\r':
			d.pos++
		default:
			return
		}
	}
}

// peek returns the next byte after whitespace, 0 at the end.
func (d *decoder) peek() byte {
	d.ws()
	if d.pos >= len(d.data) {
		return 0
	}
	return d.data[d.pos]
}

func (d *decoder) eat(c byte) bool {
	if d.peek() != c {
		return false
	}
	d.pos++
	return true
}

// telemetry decodes the whole input: one object, nothing after it.
func (d *decoder) telemetry(t *contracts.Telemetry) bool {
	if !d.telemetryObject(t) {
		return false
	}
	d.ws()
	return d.pos == len(d.data)
}

// Known keys, by field index. A key seen twice falls back: encoding/json
// merges a repeated array into the elements decoded before, which the fast
// path does not reproduce. A key that differs from a known one only by
// case falls back too: encoding/json matches names case-insensitively.
var (
	telemetryKeys = []string{"schemaVersion", "nodeId", "hostname", "pool", "time", "gpus"}
	sampleKeys    = []string{"index", "uuid", "model", "gpuUtil", "memCopyUtil", "fbUsedMiB", "fbFreeMiB", "tempC",
		"powerW", "smClockMHz", "powerLimitW", "eccSbe", "eccDbe", "throttleReasons", "lastXid", "processes", "healthy",
		"allocationId"}
	processKeys = []string{"pid", "usedMiB"}
)

// fields walks the members of an object: '{' key ':' value, ... '}'. For
// each known key it calls value with the key's index in known, positioned
// on the value; unknown keys are skipped. value reports false to fall back.
// Written once for the three structs; value is a plain func value, which
// the callers keep from escaping.
func (d *decoder) fields(known []string, value func(i int) bool) bool {
	if !d.eat('{') {
		return false
	}
	if d.eat('}') {
		return true
	}
	var seen uint64
	for {
		key, ok := d.plainString()
		if !ok || !d.eat(':') {
			return false
		}
		i := index(known, key)
		switch {
		case i >= 0:
			if seen&(1<<i) != 0 {
				return false
			}
			seen |= 1 << i
			if d.peek() == 'n' {
				// null leaves a field as it is, and sets a slice to nil:
				// here both are the zero value.
				ok = d.literal("null")
			} else {
				ok = value(i)
			}
		case foldsToKnown(known, key):
			return false
		default:
			ok = d.skip()
		}
		if !ok {
			return false
		}
		if !d.eat(',') {
			return d.eat('}')
		}
	}
}

func index(known []string, key []byte) int {
	for i, k := range known {
		if string(key) == k {
			return i
		}
	}
	return -1
}

// foldsToKnown reports whether key matches a known key the way
// encoding/json matches names: bytes.EqualFold.
func foldsToKnown(known []string, key []byte) bool {
	for _, k := range known {
		if bytes.EqualFold(key, []byte(k)) {
			return true
		}
	}
	return false
}

func (d *decoder) telemetryObject(t *contracts.Telemetry) bool {
	return d.fields(telemetryKeys, func(i int) bool {
		switch i {
		case 0:
			return d.int(&t.SchemaVersion)
		case 1:
			return d.string(&t.NodeID)
		case 2:
			return d.string(&t.Hostname)
		case 3:
			return d.string(&t.Pool)
		case 4:
			return d.time(&t.Time)
		case 5:
			if !d.eat('[') {
				return false
			}
			t.GPUs = make([]contracts.GPUSample, 0, 8)
			for more := !d.eat(']'); more; {
				t.GPUs = append(t.GPUs, contracts.GPUSample{})
				if !d.sample(&t.GPUs[len(t.GPUs)-1]) {
					return false
				}
				if more = d.eat(','); !more && !d.eat(']') {
					return false
				}
			}
			return true
		}
		return false
	})
}

func (d *decoder) sample(s *contracts.GPUSample) bool {
	return d.fields(sampleKeys, func(i int) bool {
		switch i {
		case 0:
			return d.int(&s.Index)
		case 1:
			return d.string(&s.UUID)
		case 2:
			return d.string(&s.Model)
		case 3:
			return d.float(&s.GPUUtil)
		case 4:
			return d.float(&s.MemCopyUtil)
		case 5:
			return d.int64(&s.FBUsedMiB)
		case 6:
			return d.int64(&s.FBFreeMiB)
		case 7:
			return d.float(&s.TempC)
		case 8:
			return d.float(&s.PowerW)
		case 9:
			return d.float(&s.SMClockMHz)
		case 10:
			return d.float(&s.PowerLimitW)
		case 11:
			return d.int64(&s.ECCSBE)
		case 12:
			return d.int64(&s.ECCDBE)
		case 13:
			return d.uint64(&s.ThrottleReasons)
		case 14:
			return d.int(&s.LastXID)
		case 15:
			if !d.eat('[') {
				return false
			}
			s.Processes = []contracts.GPUProcess{}
			for more := !d.eat(']'); more; {
				s.Processes = append(s.Processes, contracts.GPUProcess{})
				if !d.process(&s.Processes[len(s.Processes)-1]) {
					return false
				}
				if more = d.eat(','); !more && !d.eat(']') {
					return false
				}
			}
			return true
		case 16:
			return d.bool(&s.Healthy)
		case 17:
			return d.string(&s.AllocationID)
		}
		return false
	})
}

func (d *decoder) process(p *contracts.GPUProcess) bool {
	return d.fields(processKeys, func(i int) bool {
		switch i {
		case 0:
			return d.int(&p.PID)
		case 1:
			return d.int64(&p.UsedMiB)
		}
		return false
	})
}

func (d *decoder) literal(lit string) bool {
	if !bytes.HasPrefix(d.data[d.pos:], []byte(lit)) {
		return false
	}
	d.pos += len(lit)
	return true
}

func (d *decoder) bool(v *bool) bool {
	switch d.peek() {
	case 't':
		*v = true
		return d.literal("true")
	case 'f':
		*v = false
		return d.literal("false")
	}
	return false
}

// plainString reads a string with no escape and no control byte, which is
// all json.Marshal writes for our keys and values but '<', '>' and '&'
// (escaped as \u003c...) and non-ASCII text, which falls back when it is
// not valid UTF-8 (encoding/json replaces bad bytes with U+FFFD).
func (d *decoder) plainString() ([]byte, bool) {
	if d.peek() != '"' {
		return nil, false
	}
	start := d.pos + 1
	ascii := true
	for i := start; i < len(d.data); i++ {
		c := d.data[i]
		switch {
		case c == '"':
			s := d.data[start:i]
			if !ascii && !utf8.Valid(s) {
				return nil, false
			}
			d.pos = i + 1
			return s, true
		case c == '\\' || c < 0x20:
			return nil, false
		case c >= utf8.RuneSelf:
			ascii = false
		}
	}
	return nil, false
}

func (d *decoder) string(v *string) bool {
	s, ok := d.plainString()
	if ok {
		*v = d.dec.str(s)
	}
	return ok
}

// number returns the next JSON number literal, checked against the JSON
// grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (d *decoder) number() ([]byte, bool) {
	d.ws()
	b, i := d.data, d.pos
	start := i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i++; i < len(b) && isDigit(b[i]); i++ {
		}
	default:
		return nil, false
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || !isDigit(b[i]) {
			return nil, false
		}
		for ; i < len(b) && isDigit(b[i]); i++ {
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || !isDigit(b[i]) {
			return nil, false
		}
		for ; i < len(b) && isDigit(b[i]); i++ {
		}
	}
	d.pos = i
	return b[start:i], true
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// int64 reads an integer as encoding/json does (strconv.ParseInt of the
// literal); a fraction, an exponent or an overflow falls back, where
// encoding/json reports it.
func (d *decoder) int64(v *int64) bool {
	lit, ok := d.number()
	if !ok {
		return false
	}
	// Small non-negative integers, the usual case, without ParseInt.
	if len(lit) <= 18 && lit[0] != '-' {
		var n int64
		for _, c := range lit {
			if !isDigit(c) {
				return false
			}
			n = n*10 + int64(c-'0')
		}
		*v = n
		return true
	}
	n, err := strconv.ParseInt(string(lit), 10, 64)
	if err != nil {
		return false
	}
	*v = n
	return true
}

func (d *decoder) int(v *int) bool {
	var n int64
	if !d.int64(&n) || int64(int(n)) != n {
		return false
	}
	*v = int(n)
	return true
}

func (d *decoder) uint64(v *uint64) bool {
	lit, ok := d.number()
	if !ok {
		return false
	}
	n, err := strconv.ParseUint(string(lit), 10, 64)
	if err != nil {
		return false
	}
	*v = n
	return true
}

func (d *decoder) float(v *float64) bool {
	lit, ok := d.number()
	if !ok {
		return false
	}
	if f, ok := exactFloat(lit); ok {
		*v = f
		return true
	}
	f, err := strconv.ParseFloat(string(lit), 64)
	if err != nil {
		return false
	}
	*v = f
	return true
}

// pow10 holds the powers of ten a float64 represents exactly.
var pow10 = [...]float64{1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
	1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22}

// exactFloat converts a decimal with at most 15 significant digits, a
// fraction of at most 22 digits and no exponent ("87", "-512.25"), the
// form telemetry readings take. Both the digits, as an integer, and the
// power of ten are exact in a float64, so one division is correctly
// rounded: the result is strconv.ParseFloat's (which takes the same path).
func exactFloat(lit []byte) (float64, bool) {
	neg := lit[0] == '-'
	if neg {
		lit = lit[1:]
	}
	var mant uint64
	digits, frac, dot := 0, 0, false
	for _, c := range lit {
		switch {
		case isDigit(c):
			mant = mant*10 + uint64(c-'0')
			if mant != 0 {
				digits++
			}
			if dot {
				frac++
			}
		case c == '.' && !dot:
			dot = true
		default:
			return 0, false
		}
	}
	if digits > 15 || frac >= len(pow10) {
		return 0, false
	}
	f := float64(mant)
	if frac > 0 {
		f /= pow10[frac]
	}
	if neg {
		f = -f
	}
	return f, true
}

// time hands the string literal to time.Time.UnmarshalJSON, as
// encoding/json does, so the result is the same by construction.
func (d *decoder) time(v *time.Time) bool {
	start := d.pos
	if _, ok := d.plainString(); !ok {
		return false
	}
	return v.UnmarshalJSON(d.data[start:d.pos]) == nil
}

// skip passes over the value of an unknown key, checking its syntax as
// encoding/json would.
func (d *decoder) skip() bool {
	switch c := d.peek(); {
	case c == '"':
		return d.skipString()
	case c == '{':
		return d.nested(func() bool {
			return d.fields(nil, func(int) bool { return false })
		})
	case c == '[':
		return d.nested(func() bool {
			d.pos++
			if d.eat(']') {
				return true
			}
			for {
				if !d.skip() {
					return false
				}
				if d.eat(',') {
					continue
				}
				return d.eat(']')
			}
		})
	case c == 't':
		return d.literal("true")
	case c == 'f':
		return d.literal("false")
	case c == 'n':
		return d.literal("null")
	case c == '-' || isDigit(c):
		_, ok := d.number()
		return ok
	}
	return false
}

func (d *decoder) nested(f func() bool) bool {
	if d.depth >= maxSkipDepth {
		return false
	}
	d.depth++
	defer func() { d.depth-- }()
	return f()
}

// skipString passes over any valid JSON string: escapes are checked, bytes
// are not (encoding/json accepts invalid UTF-8 in strings).
func (d *decoder) skipString() bool {
	b := d.data
	for i := d.pos + 1; i < len(b); i++ {
		switch c := b[i]; {
		case c == '"':
			d.pos = i + 1
			return true
		case c < 0x20:
			return false
		case c == '\\':
			i++
			if i >= len(b) {
				return false
			}
			switch b[i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			case 'u':
				if i+4 >= len(b) {
					return false
				}
				for _, h := range b[i+1 : i+5] {
					if !isHex(h) {
						return false
					}
				}
				i += 4
			default:
				return false
			}
		}
	}
	return false
}

func isHex(c byte) bool { return isDigit(c) || (c|0x20 >= 'a' && c|0x20 <= 'f') }
