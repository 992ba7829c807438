package contracts

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// validTokens must be json.Decoder's token stream, faster: for every
// valid document the two hand out the same tokens and answer More alike
// at every step, and checkDoc writes the same canonical document and the
// same errors whichever it reads. The documents are every corpus case's
// generated ones (each type, each field, every kind of value), then
// documents that reach the scanner's own branches: escapes, surrogate
// pairs, invalid UTF-8, numbers in every form, whitespace everywhere,
// empty and nested containers.
func TestValidTokensAgreeWithDecoder(t *testing.T) {
	special := []string{
		`{}`, ` { } `, "\t{\n\"id\" :\r\n\"a\" ,\"x\":[ ] , \"y\" : { } }\n",
		`{"id":"a\"b\\c\/d\b\f\n\r\t\u0041\u00e9\u2028\ud83d\ude00"}`,
		`{"id":"\ud800"}`, `{"id":"\udc00\ud800x"}`, "{\"id\":\"caf\xc3\xa9\"}", "{\"id\":\"bad\xff\xfe utf8\"}",
		"{\"id\":\"\xe2\x80\xa8 raw line separator\"}", `{"id":"\\"}`, `{"id":"\\\""}`, `{"id":""}`,
		`{"n":[0,-0,1,-1,1.5,-1.5e-3,1e2,1E+2,1.0,123456789012345678901234567890,1e999999,-0.0e0]}`,
		`{"b":[true,false,null,[],{},[[]],[{}],{"a":[{"b":null}]}]}`,
		`{"id":"j","resources":{"gpu":{"count":1.0e0}},"run":{"duration":"1s"}}`,
		`{"id":"j","resources":{"gpu":{"count":1}},"run":{"duration":"1s"},"labels":{"é":"\u00e9","k":"v\u0000"}}`,
		`{"a":1,"a":2,"A":3}`, `[1,2]`, `"str"`, `3`, `null`, `true`,
	}
	all := []*schemaNode{}
	for _, v := range schemaTypes {
		all = append(all, schemaFor(v))
	}
	// Each generated document is checked against its own type's schema,
	// the special ones against every schema.
	type doc struct {
		what, text string
		schemas    []*schemaNode
	}
	var docs []doc
	for i, s := range special {
		docs = append(docs, doc{fmt.Sprintf("special %d", i), s, all})
	}
	for _, tc := range corpusCases {
		raw, err := os.ReadFile(filepath.Join("schema", tc.file))
		if err != nil {
			t.Fatal(err)
		}
		var schemaDoc map[string]any
		if err := json.Unmarshal(raw, &schemaDoc); err != nil {
			t.Fatal(err)
		}
		own := []*schemaNode{schemaFor(schemaTypes[tc.file])}
		if own[0] == nil {
			t.Fatalf("%s: no schema", tc.file)
		}
		for _, d := range generate(parseOrdered(t, tc.base), schemaDoc) {
			docs = append(docs, doc{tc.file + ": " + d.what, d.doc.String(), own})
		}
	}
	checked := 0
	for _, d := range docs {
		data := []byte(d.text)
		if !json.Valid(data) {
			t.Fatalf("%s: not valid JSON: %s", d.what, data)
		}
		if msg := tokensDiffer(data); msg != "" {
			t.Errorf("%s: %s\n%s", d.what, msg, data)
			continue
		}
		for _, s := range d.schemas {
			if msg := checksDiffer(data, s); msg != "" {
				t.Errorf("%s: %s\n%s", d.what, msg, data)
			}
		}
		checked++
	}
	if checked < 1000 {
		t.Errorf("only %d documents checked: the corpus is too thin", checked)
	}
	t.Logf("%d documents checked", checked)
}

// FuzzValidTokensAgreeWithDecoder: the same for any input json.Valid
// accepts; others take the decoder's path, which is what they did before.
func FuzzValidTokensAgreeWithDecoder(f *testing.F) {
	for _, tc := range corpusCases {
		f.Add([]byte(tc.base))
	}
	f.Add([]byte(`{"id":"a\"b\\c\u00e9\ud83d\ude00","n":[1e2,-0.5,1E+2]}`))
	f.Add([]byte("{\"id\":\"bad\xff\"}"))
	f.Add([]byte(`{"a":{"b":[{"c":[]},null,true]},"a":1}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > MaxMessageBytes || !json.Valid(data) {
			return
		}
		if msg := tokensDiffer(data); msg != "" {
			t.Fatalf("%q: %s", data, msg)
		}
		if msg := checksDiffer(data, schemaFor(JobRequest{})); msg != "" {
			t.Fatalf("%q: %s", data, msg)
		}
	})
}

// tokensDiffer walks validTokens and the decoder in step over data and
// says where they first differ ("" if nowhere).
func tokensDiffer(data []byte) string {
	fast, slow := &validTokens{data: data}, decoderTokens(data)
	for i := 0; ; i++ {
		if a, b := fast.More(), slow.More(); a != b {
			return fmt.Sprintf("step %d: More %v, the decoder's %v", i, a, b)
		}
		a, errA := fast.Token()
		b, errB := slow.Token()
		if (errA == nil) != (errB == nil) || !reflect.DeepEqual(a, b) {
			return fmt.Sprintf("step %d: token %#v (%v), the decoder's %#v (%v)", i, a, errA, b, errB)
		}
		if errA != nil {
			return ""
		}
	}
}

// checksDiffer runs checkDoc's walk over data with either token source
// and says how the outcomes differ ("" if they do not).
func checksDiffer(data []byte, s *schemaNode) string {
	outA, errA := checkTokens(data, s, &validTokens{data: data}, true)
	outB, errB := checkTokens(data, s, decoderTokens(data), true)
	if !bytes.Equal(outA, outB) {
		return fmt.Sprintf("canonical\n%s\nthe decoder's\n%s", outA, outB)
	}
	if !reflect.DeepEqual(errA, errB) { // the same type, the same field errors
		return fmt.Sprintf("error %#v, the decoder's %#v", errA, errB)
	}
	return ""
}

// TestDuplicateKeysOfALargeObject: an object's keys are a list up to
// keySetList, then a map (keySet): a key repeated after the switch is a
// duplicate whether it first came before the switch or after it.
func TestDuplicateKeysOfALargeObject(t *testing.T) {
	var env strings.Builder
	for i := range keySetList + 8 {
		fmt.Fprintf(&env, `"K%d":"v",`, i)
	}
	body := `{"id":"j","resources":{"gpu":{"count":1}},"run":{"duration":"1s","env":{` + env.String() +
		`"K0":"again","K` + fmt.Sprint(keySetList+4) + `":"again"}}}`
	_, err := DecodeJobRequest([]byte(body), "acme")
	ve, ok := errors.AsType[*ValidationError](err)
	if !ok {
		t.Fatalf("DecodeJobRequest = %v, want a ValidationError", err)
	}
	for _, key := range []string{"K0", "K" + fmt.Sprint(keySetList+4)} {
		if !slices.ContainsFunc(ve.Fields, func(f FieldError) bool {
			return f.Field == "run.env."+key && f.Reason == ReasonDuplicateField
		}) {
			t.Errorf("no duplicate_field for run.env.%s in %+v", key, ve.Fields)
		}
	}
}
