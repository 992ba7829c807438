package contracts

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/invopop/jsonschema"
)

// Money is an amount in micro-units of a currency (1 USD = 1,000,000):
// billing never uses floating point for money. In JSON and YAML it is a
// decimal string such as "4.25" (at most six decimals); a JSON number is
// accepted too and read exactly from its text, never through a float.
type Money int64

// MicrosPerUnit is how many micro-units make one unit of a currency.
const MicrosPerUnit = 1_000_000

// MaxMoney bounds any amount a document may state: a trillion units, far
// above any price or budget and far below int64 overflow when summed.
const MaxMoney = Money(1_000_000_000_000 * MicrosPerUnit)

var errBadMoney = errors.New("invalid amount")

// ParseMoney reads a decimal such as "4.25", "-0.000001" or "12" exactly.
func ParseMoney(s string) (Money, error) {
	t := strings.TrimSpace(s)
	neg := strings.HasPrefix(t, "-")
	t = strings.TrimPrefix(t, "-")
	whole, frac, dot := strings.Cut(t, ".")
	if whole == "" && frac == "" || dot && frac == "" || !digits(whole) && whole != "" || !digits(frac) && frac != "" {
		return 0, fmt.Errorf("%w %q: want a decimal such as \"4.25\"", errBadMoney, s)
	}
	if len(frac) > 6 {
		return 0, fmt.Errorf("%w %q: at most 6 decimals (micro-units)", errBadMoney, s)
	}
	if len(strings.TrimLeft(whole, "0")) > 13 {
		return 0, fmt.Errorf("%w %q: larger than %s", errBadMoney, s, MaxMoney)
	}
	w, _ := strconv.ParseInt("0"+whole, 10, 64)
	f, _ := strconv.ParseInt((frac + "000000")[:6], 10, 64)
	m := Money(w*MicrosPerUnit + f)
	if m > MaxMoney {
		return 0, fmt.Errorf("%w %q: larger than %s", errBadMoney, s, MaxMoney)
	}
	if neg {
		m = -m
	}
	return m, nil
}

func digits(s string) bool {
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// String is the exact decimal, trailing zeros dropped but at least two
// decimals: "4.25", "0.000125", "-3.00".
func (m Money) String() string {
	sign := ""
	u := uint64(m)
	if m < 0 {
		sign, u = "-", uint64(-m)
	}
	s := fmt.Sprintf("%s%d.%06d", sign, u/MicrosPerUnit, u%MicrosPerUnit)
	for strings.HasSuffix(s, "0") && len(s)-strings.IndexByte(s, '.') > 3 {
		s = s[:len(s)-1]
	}
	return s
}

// Cents is m rounded to the cent, half to even (banker's rounding): the
// rounding of every amount presented on an invoice.
func (m Money) Cents() int64 { return RoundHalfEven(int64(m), MicrosPerUnit/100) }

// CentString is m rounded to the cent and written with two decimals.
func (m Money) CentString() string {
	c := m.Cents()
	sign := ""
	if c < 0 {
		sign, c = "-", -c
	}
	return fmt.Sprintf("%s%d.%02d", sign, c/100, c%100)
}

// RoundHalfEven returns n/d rounded to the nearest integer, ties to even.
// d must be positive.
func RoundHalfEven(n, d int64) int64 {
	q, r := n/d, n%d
	if r < 0 {
		r = -r
	}
	switch {
	case 2*r > d, 2*r == d && q%2 != 0:
		if n < 0 {
			return q - 1
		}
		return q + 1
	}
	return q
}

// MarshalJSON writes m as a decimal string.
func (m Money) MarshalJSON() ([]byte, error) { return json.Marshal(m.String()) }

// UnmarshalJSON reads a decimal string or a JSON number, exactly.
func (m *Money) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	var s string
	if len(b) > 0 && b[0] == '"' {
		if err := json.Unmarshal(b, &s); err != nil {
			return fmt.Errorf("%w: %v", errBadMoney, err)
		}
	} else {
		s = string(b)
		if strings.ContainsAny(s, "eE") {
			return fmt.Errorf("%w %s: write the amount as a plain decimal such as \"4.25\"", errBadMoney, s)
		}
	}
	v, err := ParseMoney(s)
	if err != nil {
		return err
	}
	*m = v
	return nil
}

// JSONSchema describes Money in the published schemas: a decimal string
// or a JSON number (both read exactly), at most 6 decimals and at most
// MaxMoney in size, as ParseMoney reads them.
func (Money) JSONSchema() *jsonschema.Schema {
	return &jsonschema.Schema{
		AnyOf: []*jsonschema.Schema{
			{Type: "string", Pattern: moneyPattern},
			{Type: "number", MultipleOf: "0.000001", Minimum: "-1000000000000", Maximum: "1000000000000"},
		},
		Description: "an amount of the price book's currency: a decimal string such as \"4.25\" (or a number), at most 6 decimals (micro-units)",
	}
}

// moneyPattern is the string form of Money: at most 6 decimals and at
// most MaxMoney (a trillion units), leading zeros allowed.
const moneyPattern = `^-?0*([0-9]{1,12}(\.[0-9]{1,6})?|1000000000000(\.0{1,6})?)$`
