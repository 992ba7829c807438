package contracts

import (
	"encoding/json"
	"testing"
)

// slowDuration is UnmarshalJSON's general route for a JSON string: the
// decoder's text, then parse. The plain-ASCII shortcut must agree with it.
func slowDuration(b []byte) (Duration, string) {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return 0, "not a string"
	}
	var d Duration
	if err := d.parse(s); err != nil {
		return 0, err.Error()
	}
	return d, ""
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func TestPlainQuotedDurationsDecodeAsTheDecoderDoes(t *testing.T) {
	for name, in := range map[string]string{
		"seconds":       `"30s"`,
		"compound":      `"1h30m0.5s"`,
		"fraction":      `"0.5s"`,
		"zero":          `"0s"`,
		"largest":       `"2562047h47m16.854775807s"`,
		"overflow":      `"2562047h47m16.854775808s"`,
		"no unit":       `"30"`,
		"word":          `"soon"`,
		"negative":      `"-5s"`,
		"empty":         `""`,
		"space inside":  `"3 s"`,
		"escaped":       `"3\u0073"`,
		"escaped quote": `"3s\""`,
		"non-ASCII":     `"3µs"`,
		"invalid UTF-8": "\"3\xffs\"",
		"control byte":  "\"3\ts\"",
		"unterminated":  `"3s`,
		"number":        `2.5`,
		"bool":          `true`,
		"null":          `null`,
		"huge number":   `1e300`,
	} {
		t.Run(name, func(t *testing.T) {
			b := []byte(in)
			var got Duration
			gotErr := errText(got.UnmarshalJSON(b))
			if _, plain := plainQuoted(b); !plain {
				return // the general route, unchanged
			}
			want, wantErr := slowDuration(b)
			if got != want || gotErr != wantErr {
				t.Fatalf("%s: shortcut gave %v %q, the decoder's route %v %q", in, got, gotErr, want, wantErr)
			}
		})
	}
}

// FuzzPlainQuotedDuration: for any text, encoded as our writers encode it,
// the shortcut and the decoder's route give the same duration or error.
func FuzzPlainQuotedDuration(f *testing.F) {
	for _, s := range []string{"30s", "1h", "0.5ms", "-1s", "x", "", "9999999999h", "3\"s", `\`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b, err := json.Marshal(s)
		if err != nil {
			t.Skip()
		}
		var got Duration
		gotErr := errText(got.UnmarshalJSON(b))
		want, wantErr := slowDuration(b)
		if got != want || gotErr != wantErr {
			t.Fatalf("%s: UnmarshalJSON gave %v %q, the decoder's route %v %q", b, got, gotErr, want, wantErr)
		}
	})
}

// BenchmarkDurationUnmarshal: the shortcut beside the decoder's route it
// replaces for the common form, in the same run.
func BenchmarkDurationUnmarshal(b *testing.B) {
	in := []byte(`"1h30m"`)
	b.Run("shortcut", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var d Duration
			if err := d.UnmarshalJSON(in); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decoder", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, e := slowDuration(in); e != "" {
				b.Fatal(e)
			}
		}
	})
}
