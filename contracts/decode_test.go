package contracts

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// The decoder against the published schema, with a corpus generated from
// the schema itself: every object of a valid document gets, for each of
// its schema's properties (present or not), every value of a list that
// spans the JSON types and the schema's own enums, patterns, formats and
// bounds; the same key in other letter cases; a duplicated key; an unknown
// key; a missing key. Each document is judged by an independent JSON
// Schema validator (the oracle) and by the decoder, and the two must agree.
//
// Where the oracle cannot speak, the expected verdict is stated here:
// JSON Schema says nothing about duplicate keys (RFC 8259 leaves them
// unpredictable), and the decoder refuses them.
//
// A decoder may refuse more than the schema only by a rule a schema cannot
// state; contextual lists those, each by field and reason, and any other
// extra refusal fails the test.

// corpusCase is one message type and how to decode it.
type corpusCase struct {
	file   string
	base   string
	decode func([]byte) error
	// contextual are the field errors the decoder may add to what the
	// schema says: rules that depend on something outside the document
	// (the subject's tenant) or tie fields together.
	contextual []FieldError
	// extra are documents written out to meet contextual rules the
	// generated corpus does not reach.
	extra []string
}

var corpusCases = []corpusCase{
	{
		file: "job-request.json",
		base: `{"schemaVersion":1,"id":"job-1","tenant":"acme","name":"train","priority":"high","pool":"gpu-a",
			"resources":{"gpu":{"count":2,"model":"L4","memoryMiB":1024,"nodes":1,"topology":"nvlink"},"cpuMilli":1000,"memoryMiB":2048},
			"run":{"duration":"30s","command":["python","train.py"],"args":["--epochs","3"],"env":{"A":"1"},"exitCode":0,"checkpoint":true,
				"image":"ghcr.io/acme/train:v3","workingDir":"/work","mounts":[{"source":"/data/imagenet","target":"/data","readOnly":true}],
				"shmSizeMiB":1024,"user":"1000:1000"},
			"labels":{"team":"ml"},"nodeSelector":{"zone":"a"},
			"tolerations":[{"key":"spot","operator":"Equal","value":"true","effect":"NoSchedule"}],
			"dependsOn":["job-0"],"placementTimeout":"5m","expectedRunTime":"1m"}`,
		decode: func(b []byte) error { _, err := DecodeJobRequest(b, "acme"); return err },
		contextual: []FieldError{
			{Field: "tenant", Reason: ReasonTenantMismatch},         // must equal the subject's tenant
			{Field: "run", Reason: ReasonMissingField},              // duration, command or image
			{Field: "run.env", Reason: ReasonConflictingRun},        // env only with a command or an image
			{Field: "run.image", Reason: ReasonImageInvalid},        // a reference name.ParseReference takes
			{Field: "run.exitCode", Reason: ReasonConflictingRun},   // a simulated run's, not an image's
			{Field: "run.args", Reason: ReasonConflictingRun},       // args follow a command or an image
			{Field: "run.workingDir", Reason: ReasonConflictingRun}, // container fields need an image
			{Field: "run.mounts", Reason: ReasonConflictingRun},
			{Field: "run.shmSizeMiB", Reason: ReasonConflictingRun},
			{Field: "run.user", Reason: ReasonConflictingRun},
			{Field: "run.shmSizeMiB", Reason: ReasonOutOfRange},             // at most the run's memory limit
			{Field: "run.command", Reason: ReasonOutOfRange},                // command and args bounded together
			{Field: "run.mounts[0].source", Reason: ReasonMountNotAllowed},  // not the host's /proc, /sys or /dev
			{Field: "run.mounts[0].target", Reason: ReasonMountNotAllowed},  // nor over the container's
			{Field: "run.mounts[1].target", Reason: ReasonInvalidValue},     // two mounts on one target
			{Field: "run.command", Reason: ReasonInvalidValue},              // the program (command[0]) is not empty
			{Field: "resources.gpu.models", Reason: ReasonConflictingRun},   // model or models
			{Field: "resources.gpu.count", Reason: ReasonOutOfRange},        // one GPU for a MIG instance or a share
			{Field: "resources.gpu.migProfile", Reason: ReasonInvalidValue}, // a profile of an allowed model
			{Field: "resources.gpu.nodes", Reason: ReasonInvalidValue},      // count splits evenly over nodes
			{Field: "resources.gpu.share", Reason: ReasonInvalidValue},      // MIG or share, not both
			{Field: "tolerations[0]", Reason: ReasonInvalidValue},           // operator and key/value go together
			{Field: "tolerations[1]", Reason: ReasonInvalidValue},
			{Field: "dependsOn", Reason: ReasonDependencyCycle}, // not the job itself
			{Field: "labels", Reason: ReasonInvalidValue},       // key and value together at most MaxLabelBytes
			{Field: "nodeSelector", Reason: ReasonInvalidValue},
			{Field: "run.env", Reason: ReasonInvalidValue},    // a variable name without '='
			{Field: "run.duration", Reason: ReasonOutOfRange}, // at most MaxJobDuration: a pattern cannot bound it
			{Field: "placementTimeout", Reason: ReasonOutOfRange},
			{Field: "expectedRunTime", Reason: ReasonOutOfRange},
		},
		extra: []string{
			`{"id":"j","resources":{"gpu":{"count":1,"model":"A100-80GB","migProfile":"1g.10gb","share":{"memoryMiB":1,"computePercent":1}}},"run":{"duration":"1s"}}`,
			`{"id":"j","resources":{"gpu":{"count":1}},"run":{"duration":"1s"},"tolerations":[{"key":"a"},{"operator":"Exists","value":"v"}]}`,
			`{"id":"j","dependsOn":["j"],"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`,
			`{"id":"j","labels":{"` + strings.Repeat("k", 300) + `":"v"},"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`,
			`{"id":"j","nodeSelector":{"` + strings.Repeat("k", 300) + `":"v"},"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`,
			`{"id":"j","resources":{"gpu":{"count":1}},"run":{"command":["x"],"env":{"A=B":"1"}}}`,
			`{"id":"j","resources":{"gpu":{"count":1}},"run":{"duration":"1s","env":{"A":"1"},"args":["a"]}}`,
			`{"id":"j","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/proc/1","target":"/dev/x"}]}}`,
			`{"id":"j","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/a","target":"/x"},{"source":"/b","target":"/x"}]}}`,
			`{"id":"j","resources":{"gpu":{"count":1}},"run":{"image":"busybox","command":["` + strings.Repeat(`x","`, 200) + `y"],"args":["` + strings.Repeat(`x","`, 200) + `y"]}}`,
		},
	},
	{
		file:   "cancel-request.json",
		base:   `{"schemaVersion":1,"jobId":"job-1","reason":"no longer needed"}`,
		decode: func(b []byte) error { _, err := DecodeCancelRequest(b); return err },
	},
	{
		file:   "node-admin-request.json",
		base:   `{"reason":"maintenance"}`,
		decode: func(b []byte) error { _, err := DecodeNodeAdminRequest(b); return err },
	},
	{
		file:   "budget.json",
		base:   `{"schemaVersion":1,"tenant":"acme","period":"monthly","limit":"100.50","policy":"reject"}`,
		decode: func(b []byte) error { _, err := DecodeBudget(b, "acme"); return err },
		contextual: []FieldError{
			{Field: "tenant", Reason: ReasonTenantMismatch},
			{Field: "limit", Reason: ReasonOutOfRange}, // more than 0, at most MaxMoney
		},
	},
	{
		file: "price-book.json",
		base: `{"schemaVersion":1,"versions":[{"id":"v1","effectiveFrom":"2026-11-01T00:00:00Z","currency":"USD",
			"gpu":{"L4":{"onDemand":"0.80","spot":"0.32","reserved":"0.56"},"*":{"onDemand":"1.00"}},
			"cpuCoreHour":"0.04","memoryGiBHour":"0.005","note":"tour"}]}`,
		decode: func(b []byte) error { _, err := DecodePriceBook(b); return err },
		contextual: []FieldError{
			{Field: "versions[0].gpu.*", Reason: ReasonOutOfRange},           // prices more than 0, at most 100000
			{Field: "versions[0].cpuCoreHour", Reason: ReasonOutOfRange},     // at least 0
			{Field: "versions[0].memoryGiBHour", Reason: ReasonOutOfRange},   // at least 0
			{Field: "versions[0].effectiveFrom", Reason: ReasonInvalidValue}, // a whole second
			{Field: "versions[0].effectiveFrom", Reason: ReasonMissingField}, // not the zero time
		},
		extra: []string{`{"versions":[{"id":"v1","effectiveFrom":"0001-01-01T00:00:00Z","currency":"USD","gpu":{"*":{"onDemand":"1"}}}]}`},
	},
	{
		file:   "tenant-quota.json",
		base:   `{"schemaVersion":1,"tenant":"acme","weight":2.5,"strictFifo":true,"pools":{"gpu-a":{"guarantee":4,"max":8},"*":{"guarantee":1}},"updatedAt":"2026-11-01T00:00:00Z"}`,
		decode: func(b []byte) error { _, err := DecodeTenantQuota(b, "acme"); return err },
		contextual: []FieldError{
			{Field: "tenant", Reason: ReasonTenantMismatch},
			{Field: "pools.gpu-a.max", Reason: ReasonOutOfRange}, // at least the guarantee
		},
	},
	{
		file: "pool-config.json",
		base: `{"schemaVersion":1,"pool":"gpu-a","policy":"spread","updatedAt":"2026-11-01T00:00:00Z",
			"runtime":{"allowHostCommands":true,"mountRoots":["/data","/scratch"],"hostNetwork":true}}`,
		decode: func(b []byte) error { _, err := DecodePoolConfig(b, "gpu-a"); return err },
		contextual: []FieldError{
			{Field: "pool", Reason: ReasonInvalidValue},                     // the pool it is stored for
			{Field: "runtime.mountRoots[0]", Reason: ReasonMountNotAllowed}, // not /proc, /sys, /dev
		},
		extra: []string{`{"policy":"spread","runtime":{"mountRoots":["/dev/shm"]}}`},
	},
	{
		// The gateway checks the GPU against the node's inventory.
		file:   "fault-request.json",
		base:   `{"kind":"overheat","gpu":"0","code":0,"duration":"30s"}`,
		decode: func(b []byte) error { _, err := DecodeFaultRequest(b); return err },
		contextual: []FieldError{
			{Field: "gpu", Reason: ReasonInvalidValue},      // none for a machine-wide kind
			{Field: "code", Reason: ReasonInvalidValue},     // only for xid
			{Field: "duration", Reason: ReasonInvalidValue}, // only for overheat and agent_pause
			{Field: "duration", Reason: ReasonOutOfRange},   // at most MaxFaultDuration
		},
	},
}

// oracle compiles the published schema file with the independent validator.
func oracle(t *testing.T, file string) *jsonschema.Schema {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("schema", file))
	if err != nil {
		t.Fatal(err)
	}
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	c.AssertFormat()
	url := "https://gpuplane.dev/schemas/v1/" + file
	if err := c.AddResource(url, doc); err != nil {
		t.Fatal(err)
	}
	s, err := c.Compile(url)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestDecoderAgreesWithSchema(t *testing.T) {
	for _, tc := range corpusCases {
		t.Run(tc.file, func(t *testing.T) {
			sch := oracle(t, tc.file)
			raw, _ := os.ReadFile(filepath.Join("schema", tc.file))
			var schemaDoc map[string]any
			if err := json.Unmarshal(raw, &schemaDoc); err != nil {
				t.Fatal(err)
			}
			base := parseOrdered(t, tc.base)
			if err := tc.decode([]byte(tc.base)); err != nil {
				t.Fatalf("the base document is refused: %v", err)
			}
			docs := generate(base, schemaDoc)
			for i, x := range tc.extra {
				docs = append(docs, genDoc{what: fmt.Sprintf("extra %d", i), doc: scalar(x)})
			}
			var accepted, refused, dupes int
			used := map[FieldError]bool{}
			for _, d := range docs {
				text := d.doc.String()
				inst, err := jsonschema.UnmarshalJSON(strings.NewReader(text))
				if err != nil {
					t.Fatalf("%s: generated invalid JSON %s: %v", d.what, text, err)
				}
				schemaOK := sch.Validate(inst) == nil
				if d.duplicate {
					schemaOK = false
					dupes++
				}
				decErr := tc.decode([]byte(text))
				switch {
				case schemaOK && decErr == nil:
					accepted++
				case !schemaOK && decErr != nil:
					refused++
				case !schemaOK:
					t.Errorf("%s: the schema refuses it, the decoder accepts it:\n%s", d.what, text)
				case !onlyContextual(decErr, tc.contextual, used):
					t.Errorf("%s: the schema accepts it, the decoder refuses it: %v\n%s", d.what, decErr, text)
				default:
					accepted++
				}
			}
			// Every rule listed as beyond the schema must have been met:
			// the list says no more than it must.
			for _, c := range tc.contextual {
				if !used[c] {
					t.Errorf("contextual rule %s on %s was never needed: drop it", c.Reason, c.Field)
				}
			}
			t.Logf("%s: %d documents: %d accepted by both, %d refused by both (%d with a duplicated key)",
				tc.file, len(docs), accepted, refused, dupes)
			if accepted == 0 || refused == 0 || len(docs) < 30 {
				t.Errorf("the corpus is too thin: %d documents, %d accepted, %d refused", len(docs), accepted, refused)
			}
		})
	}
}

// onlyContextual reports whether err lists only rules of allowed, and
// marks those it used.
func onlyContextual(err error, allowed []FieldError, used map[FieldError]bool) bool {
	var ve *ValidationError
	if !errors.As(err, &ve) {
		return false
	}
	var hits []FieldError
	for _, f := range ve.Fields {
		i := slices.IndexFunc(allowed, func(a FieldError) bool {
			prefix, wild := strings.CutSuffix(a.Field, "*")
			return a.Reason == f.Reason && (a.Field == f.Field || wild && strings.HasPrefix(f.Field, prefix))
		})
		if i < 0 {
			return false
		}
		hits = append(hits, allowed[i])
	}
	for _, h := range hits {
		used[h] = true
	}
	return true
}

// node is a JSON value that keeps its keys' order and may repeat a key.
type node struct {
	kind  byte // '{', '[', or 0 for a scalar in raw
	keys  []string
	vals  []*node
	items []*node
	raw   string
}

func (n *node) String() string {
	var b strings.Builder
	n.write(&b)
	return b.String()
}

func (n *node) write(b *strings.Builder) {
	switch n.kind {
	case '{':
		b.WriteByte('{')
		for i, k := range n.keys {
			if i > 0 {
				b.WriteByte(',')
			}
			kb, _ := json.Marshal(k)
			b.Write(kb)
			b.WriteByte(':')
			n.vals[i].write(b)
		}
		b.WriteByte('}')
	case '[':
		b.WriteByte('[')
		for i, v := range n.items {
			if i > 0 {
				b.WriteByte(',')
			}
			v.write(b)
		}
		b.WriteByte(']')
	default:
		b.WriteString(n.raw)
	}
}

func (n *node) clone() *node {
	c := &node{kind: n.kind, raw: n.raw, keys: slices.Clone(n.keys)}
	for _, v := range n.vals {
		c.vals = append(c.vals, v.clone())
	}
	for _, v := range n.items {
		c.items = append(c.items, v.clone())
	}
	return c
}

func parseOrdered(t *testing.T, s string) *node {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	n, err := readNode(dec)
	if err != nil {
		t.Fatalf("base document: %v", err)
	}
	return n
}

func readNode(dec *json.Decoder) (*node, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch t := tok.(type) {
	case json.Delim:
		n := &node{kind: byte(t)}
		for dec.More() {
			if t == '{' {
				k, err := dec.Token()
				if err != nil {
					return nil, err
				}
				n.keys = append(n.keys, k.(string))
			}
			v, err := readNode(dec)
			if err != nil {
				return nil, err
			}
			if t == '{' {
				n.vals = append(n.vals, v)
			} else {
				n.items = append(n.items, v)
			}
		}
		_, err := dec.Token()
		return n, err
	case nil:
		return &node{raw: "null"}, nil
	case string:
		b, _ := json.Marshal(t)
		return &node{raw: string(b)}, nil
	default:
		return &node{raw: fmt.Sprint(t)}, nil
	}
}

func scalar(raw string) *node { return &node{raw: raw} }

// genDoc is one generated document and what was done to the base.
type genDoc struct {
	what      string
	doc       *node
	duplicate bool
}

// schemaAt resolves a schema object (following $ref into $defs).
func schemaAt(root map[string]any, s any) map[string]any {
	m, _ := s.(map[string]any)
	for m != nil {
		ref, ok := m["$ref"].(string)
		if !ok {
			break
		}
		defs, _ := root["$defs"].(map[string]any)
		m, _ = defs[strings.TrimPrefix(ref, "#/$defs/")].(map[string]any)
	}
	return m
}

// candidates are the values tried for a property of schema s: every JSON
// type, plus values around what the schema says of it.
func candidates(root, s map[string]any) []*node {
	raws := []string{`null`, `true`, `false`, `0`, `1`, `-1`, `2.5`, `1.0`, `1e2`, `1e400`, `""`, `"x"`, `{}`, `[]`}
	for _, e := range asSlice(s["enum"]) {
		b, _ := json.Marshal(e)
		raws = append(raws, string(b))
		if str, ok := e.(string); ok && str != "" {
			up, _ := json.Marshal(strings.ToUpper(str))
			raws = append(raws, string(up))
		}
	}
	if p, ok := s["pattern"].(string); ok {
		switch p {
		case durationPattern:
			raws = append(raws, `"30s"`, `"1h30m"`, `"0"`, `"0s"`, `".5s"`, `"1.s"`, `"2h45m0.5s"`, `"1µs"`, `"+30s"`, `"-30s"`,
				`"30"`, `"abc"`, `"1e3s"`, `"30 s"`, `"s"`, `"99999999999h"`, `"720h"`, `"721h"`)
		case idPattern:
			raws = append(raws, `"job-2"`, `"A_b-9"`, `"-a"`, `"_a"`, `"a b"`, `"a.b"`,
				`"`+strings.Repeat("a", 128)+`"`, `"`+strings.Repeat("a", 129)+`"`)
		default:
			raws = append(raws, `"USD"`, `"usd"`, `"4.25"`, `"-1"`, `"0"`, `"1.1234567"`, `"1e3"`, `"4."`, `" 4"`, `"acme"`, `"gpu-a"`, `"A"`, `"-a"`)
		}
	}
	if p, ok := s["pattern"].(string); ok && p == moneyPattern {
		raws = append(raws, `"1000000000000"`, `"1000000000000.000001"`, `"999999999999.999999"`, `"0001.5"`, `"9999999999999"`, `"-0.000001"`, `".5"`)
	}
	if s["type"] == "number" {
		raws = append(raws, `4.25`, `4.25e-1`, `4.1234567`, `1e12`, `1.0000001e12`, `-3`, `1e-7`, `12345678901234567890`)
	}
	if s["format"] == "date-time" {
		raws = append(raws, `"2026-11-03T10:00:00Z"`, `"2026-11-03T10:00:00.5+01:00"`, `"2026-11-03"`, `"yesterday"`)
	}
	for _, k := range []string{"minimum", "maximum"} {
		if v, ok := s[k].(float64); ok {
			raws = append(raws, fmt.Sprint(v-1), fmt.Sprint(v), fmt.Sprint(v+1))
		}
	}
	if n, ok := s["maxLength"].(float64); ok {
		for _, r := range []string{"a", "é"} {
			for _, l := range []int{int(n), int(n) + 1} {
				b, _ := json.Marshal(strings.Repeat(r, l))
				raws = append(raws, string(b))
			}
		}
	}
	if s["type"] == "integer" {
		raws = append(raws, `9223372036854775807`, `9223372036854775808`, `-9223372036854775809`, `5e0`)
	}
	if s["type"] == "string" {
		raws = append(raws, `"L4"`, `"any"`, `"H100-80GB"`, `"gpu-a"`, `"acme"`)
	}
	for _, b := range asSlice(s["anyOf"]) {
		for _, c := range candidates(root, schemaAt(root, b)) {
			raws = append(raws, c.raw)
		}
	}
	var out []*node
	seen := map[string]bool{}
	for _, r := range raws {
		if !seen[r] {
			seen[r] = true
			out = append(out, scalar(r))
		}
	}
	// Values of the property's own shape: one element of each candidate,
	// and as many elements as the schema allows, and one more.
	if items := schemaAt(root, s["items"]); items != nil {
		var fill *node
		for _, c := range candidates(root, items) {
			out = append(out, &node{kind: '[', items: []*node{c}})
			if fill == nil && c.raw != "null" && items["type"] != nil && typeOf(c) == items["type"] && items["enum"] == nil && items["pattern"] == nil {
				fill = c
			}
		}
		if enum := asSlice(items["enum"]); len(enum) > 0 {
			b, _ := json.Marshal(enum[0])
			fill = scalar(string(b))
		} else if items["pattern"] != nil {
			fill = scalar(`"job-0"`)
		}
		if n, ok := s["maxItems"].(float64); ok && fill != nil {
			for _, l := range []int{int(n), int(n) + 1} {
				arr := &node{kind: '['}
				for range l {
					arr.items = append(arr.items, fill.clone())
				}
				out = append(out, arr)
			}
		}
	}
	if add := schemaAt(root, s["additionalProperties"]); add != nil {
		for _, c := range candidates(root, add) {
			out = append(out, &node{kind: '{', keys: []string{"k"}, vals: []*node{c}})
		}
		if n, ok := s["maxProperties"].(float64); ok {
			for _, l := range []int{int(n), int(n) + 1} {
				obj := &node{kind: '{'}
				for i := range l {
					obj.keys = append(obj.keys, fmt.Sprintf("k%d", i))
					obj.vals = append(obj.vals, scalar(`"v"`))
				}
				out = append(out, obj)
			}
		}
	}
	return out
}

func asSlice(v any) []any { s, _ := v.([]any); return s }

// typeOf is the JSON Schema type of a scalar candidate.
func typeOf(n *node) string {
	switch {
	case strings.HasPrefix(n.raw, `"`):
		return "string"
	case n.raw == "true" || n.raw == "false":
		return "boolean"
	case n.raw == "null":
		return "null"
	case strings.ContainsAny(n.raw, ".eE"):
		return "number"
	}
	return "integer"
}

// generate returns the corpus for base under the schema document root.
func generate(base *node, root map[string]any) []genDoc {
	var out []genDoc
	var walk func(cur *node, s map[string]any, path string, edit func(func(*node)) *node)
	walk = func(cur *node, s map[string]any, path string, edit func(func(*node)) *node) {
		if s == nil {
			return
		}
		switch cur.kind {
		case '{':
			props, _ := s["properties"].(map[string]any)
			names := make([]string, 0, len(props))
			for k := range props {
				names = append(names, k)
			}
			sort.Strings(names)
			add := func(what string, dup bool, f func(*node)) {
				out = append(out, genDoc{what: path + what, doc: edit(f), duplicate: dup})
			}
			add(": unknown key", false, func(n *node) { n.keys = append(n.keys, "zzUnknown"); n.vals = append(n.vals, scalar("1")) })
			for _, k := range names {
				ps := schemaAt(root, props[k])
				i := slices.Index(cur.keys, k)
				for _, c := range candidates(root, ps) {
					add(fmt.Sprintf(".%s = %s", k, c), false, func(n *node) {
						if i >= 0 {
							n.vals[i] = c.clone()
						} else {
							n.keys = append(n.keys, k)
							n.vals = append(n.vals, c.clone())
						}
					})
				}
				if i < 0 {
					continue
				}
				v := cur.vals[i]
				for _, variant := range []string{strings.ToUpper(k[:1]) + k[1:], strings.ToUpper(k)} {
					if variant == k {
						continue
					}
					add(fmt.Sprintf(": key %s for %s", variant, k), false, func(n *node) { n.keys[i] = variant })
					add(fmt.Sprintf(": key %s beside %s", variant, k), false, func(n *node) {
						n.keys = append(n.keys, variant)
						n.vals = append(n.vals, v.clone())
					})
				}
				add(fmt.Sprintf(": %s twice, same value", k), true, func(n *node) {
					n.keys = append(n.keys, k)
					n.vals = append(n.vals, v.clone())
				})
				add(fmt.Sprintf(": %s twice, then null", k), true, func(n *node) {
					n.keys = append(n.keys, k)
					n.vals = append(n.vals, scalar("null"))
				})
				add(fmt.Sprintf(": without %s", k), false, func(n *node) {
					n.keys = slices.Delete(n.keys, i, i+1)
					n.vals = slices.Delete(n.vals, i, i+1)
				})
				walk(v, ps, path+"."+k, func(f func(*node)) *node {
					return edit(func(n *node) { f(n.vals[i]) })
				})
			}
			if addl := schemaAt(root, s["additionalProperties"]); addl != nil && len(props) == 0 {
				for _, c := range candidates(root, addl) {
					add(fmt.Sprintf(": map entry = %s", c), false, func(n *node) {
						n.keys = append(n.keys, "k2")
						n.vals = append(n.vals, c.clone())
					})
				}
				if len(cur.keys) > 0 {
					k, v := cur.keys[0], cur.vals[0]
					add(fmt.Sprintf(": map key %s twice", k), true, func(n *node) {
						n.keys = append(n.keys, k)
						n.vals = append(n.vals, v.clone())
					})
					walk(v, addl, path+"."+k, func(f func(*node)) *node {
						return edit(func(n *node) { f(n.vals[0]) })
					})
				}
			}
		case '[':
			items := schemaAt(root, s["items"])
			for j, v := range cur.items {
				walk(v, items, fmt.Sprintf("%s[%d]", path, j), func(f func(*node)) *node {
					return edit(func(n *node) { f(n.items[j]) })
				})
			}
		}
	}
	walk(base, schemaAt(root, root), "", func(f func(*node)) *node {
		c := base.clone()
		f(c)
		return c
	})
	// Whole-document cases.
	for _, raw := range []string{`null`, `[]`, `"x"`, `1`, `true`} {
		out = append(out, genDoc{what: "document " + raw, doc: scalar(raw)})
	}
	return out
}

// TestDecoderRefusesWhatTheProbeFound: the cases a hostile-input probe
// found the old decoder accepted, each refused with its reason and field.
func TestDecoderRefusesWhatTheProbeFound(t *testing.T) {
	const ok = `"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}`
	tests := map[string]struct {
		body   string
		reason Reason
		field  string
	}{
		"Count beside count":          {`{"id":"a","resources":{"gpu":{"count":1,"Count":1000}},"run":{"duration":"1s"}}`, ReasonUnknownField, "resources.gpu.Count"},
		"ID for id":                   {`{"ID":"a",` + ok + `}`, ReasonUnknownField, "ID"},
		"resources twice":             {`{"id":"a",` + ok + `,"resources":{"gpu":{"count":1000,"model":"L4"}}}`, ReasonDuplicateField, "resources"},
		"id twice":                    {`{"id":"a","id":"b",` + ok + `}`, ReasonDuplicateField, "id"},
		"null name":                   {`{"id":"a","name":null,` + ok + `}`, ReasonInvalidType, "name"},
		"null count":                  {`{"id":"a","resources":{"gpu":{"count":null}},"run":{"duration":"1s"}}`, ReasonInvalidType, "resources.gpu.count"},
		"null labels":                 {`{"id":"a","labels":null,` + ok + `}`, ReasonInvalidType, "labels"},
		"null command":                {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s","command":null}}`, ReasonInvalidType, "run.command"},
		"null share":                  {`{"id":"a","resources":{"gpu":{"count":1,"share":null}},"run":{"duration":"1s"}}`, ReasonInvalidType, "resources.gpu.share"},
		"null duration":               {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":null,"command":["x"]}}`, ReasonInvalidDuration, "run.duration"},
		"number for duration":         {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":30}}`, ReasonInvalidDuration, "run.duration"},
		"number for placementTimeout": {`{"id":"a","placementTimeout":60,` + ok + `}`, ReasonInvalidDuration, "placementTimeout"},
		"negative duration string":    {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"-1s"}}`, ReasonInvalidDuration, "run.duration"},
		"overflowing duration":        {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"9999999999h"}}`, ReasonOutOfRange, "run.duration"},
		"empty priority":              {`{"id":"a","priority":"",` + ok + `}`, ReasonUnknownPriority, "priority"},
		"empty model":                 {`{"id":"a","resources":{"gpu":{"count":1,"model":""}},"run":{"duration":"1s"}}`, ReasonInvalidValue, "resources.gpu.model"},
		"schema version 0 written":    {`{"schemaVersion":0,"id":"a",` + ok + `}`, ReasonUnsupportedSchema, "schemaVersion"},
		"count beyond int64":          {`{"id":"a","resources":{"gpu":{"count":1e400}},"run":{"duration":"1s"}}`, ReasonOutOfRange, "resources.gpu.count"},
		"fractional count":            {`{"id":"a","resources":{"gpu":{"count":1.5}},"run":{"duration":"1s"}}`, ReasonInvalidType, "resources.gpu.count"},
		"body null":                   {`null`, ReasonInvalidType, ""},
		"body an array":               {`[{"id":"a"}]`, ReasonInvalidType, ""},
		"escaped key still exact":     {`{"\u0049D":"a",` + ok + `}`, ReasonUnknownField, "ID"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeJobRequest([]byte(tt.body), "acme")
			ve, isVE := errors.AsType[*ValidationError](err)
			if !isVE {
				t.Fatalf("DecodeJobRequest = %v; want a *ValidationError", err)
			}
			if !slices.ContainsFunc(ve.Fields, func(f FieldError) bool { return f.Reason == tt.reason && f.Field == tt.field && f.Message != "" }) {
				t.Fatalf("errors %v lack %s on %q", ve.Fields, tt.reason, tt.field)
			}
		})
	}
}

func TestDecoderMessages(t *testing.T) {
	tests := map[string]struct{ body, want string }{
		"body null":  {`null`, "the body must be a JSON object, not null"},
		"case hint":  {`{"id":"a","resources":{"gpu":{"Count":2}},"run":{"duration":"1s"}}`, `did you mean "count"?`},
		"overflow":   {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"9999999999h"}}`, "longer than the largest duration, 2562047h47m16.854775807s"},
		"enum named": {`{"id":"a","priority":"",` + `"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, `"" is not one of "critical", "high", "normal", "best-effort"`},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeJobRequest([]byte(tt.body), "acme")
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("DecodeJobRequest = %v; want a message containing %q", err, tt.want)
			}
		})
	}
}

// TestDecoderReportsEveryProblem: a value the schema refuses does not hide
// Validate's findings on other fields.
func TestDecoderReportsEveryProblem(t *testing.T) {
	_, err := DecodeJobRequest([]byte(`{"id":"a","priority":"","resources":{"gpu":{"count":0}},"run":{"duration":"1s"}}`), "acme")
	ve, ok := errors.AsType[*ValidationError](err)
	if !ok || len(ve.Fields) != 2 || ve.Fields[0].Field != "priority" || ve.Fields[1].Field != "resources.gpu.count" {
		t.Fatalf("DecodeJobRequest = %v; want priority and resources.gpu.count", err)
	}
}

// TestDecoderCanonicalIntegers: JSON Schema counts 1.0 and 1e1 as
// integers, so the decoder takes them too.
func TestDecoderCanonicalIntegers(t *testing.T) {
	r, err := DecodeJobRequest([]byte(`{"id":"a","resources":{"gpu":{"count":1e1,"memoryMiB":1024.0}},"run":{"duration":"1s"}}`), "acme")
	if err != nil || r.Resources.GPU.Count != 10 || r.Resources.GPU.MemoryMiB != 1024 {
		t.Fatalf("DecodeJobRequest = %+v, %v; want count 10 and 1024 MiB", r.Resources.GPU, err)
	}
}

// TestDurationNeverWrapsNegative: a stored document may still carry a
// duration as seconds; one too large for a Duration is an error, never a
// negative duration.
func TestDurationNeverWrapsNegative(t *testing.T) {
	for _, raw := range []string{`1e300`, `-1e300`, `9223372037`, `1e400`, `"9999999999h"`, `"2562048h"`} {
		var d Duration
		err := d.UnmarshalJSON([]byte(raw))
		if err == nil || !strings.Contains(err.Error(), "largest duration") {
			t.Errorf("UnmarshalJSON(%s) = %v, %v; want an error naming the largest duration", raw, d.D(), err)
		}
		if d < 0 {
			t.Errorf("UnmarshalJSON(%s) left %v", raw, d.D())
		}
	}
	var d Duration
	if err := d.UnmarshalJSON([]byte(`9223372036`)); err != nil || d.D() != 9223372036*time.Second {
		t.Errorf("UnmarshalJSON(9223372036) = %v, %v; want 9223372036s", d.D(), err)
	}
}

// TestCheckJSONNeedsASchema: CheckJSON is only for published types.
func TestCheckJSONNeedsASchema(t *testing.T) {
	if _, err := CheckJSON([]byte(`{}`), struct{}{}); err == nil {
		t.Fatal("CheckJSON of a type without a schema succeeded")
	}
	out, err := CheckJSON([]byte(`{"kind":"xid","code":79.0}`), FaultRequest{})
	if err != nil || string(out) != `{"kind":"xid","code":79}` {
		t.Fatalf("CheckJSON = %s, %v", out, err)
	}
}

func TestWithJobIDAndTopLevelID(t *testing.T) {
	tests := []struct{ in, want string }{
		{`{}`, `{"id":"j"}`},
		{` { } `, `{"id":"j"}`},
		{`{"run":{}}`, `{"id":"j","run":{}}`},
	}
	for _, tt := range tests {
		got, ok := WithJobID([]byte(tt.in), "j")
		if !ok || string(got) != tt.want {
			t.Errorf("WithJobID(%s) = %s, %v; want %s", tt.in, got, ok, tt.want)
		}
	}
	for _, in := range []string{`null`, `[]`, `"x"`, ``} {
		if _, ok := WithJobID([]byte(in), "j"); ok {
			t.Errorf("WithJobID(%s) succeeded", in)
		}
	}
	ids := map[string]string{
		`{"id":"a","x":1}`:          "a",
		`{"x":{"id":"b"},"id":"a"}`: "a",
		`{"id":"a","id":"b"}`:       "",
		`{"ID":"a"}`:                "",
		`{"id":7}`:                  "",
		`{"id":"a",`:                "",
	}
	for in, want := range ids {
		if got := topLevelID([]byte(in)); got != want {
			t.Errorf("topLevelID(%s) = %q, want %q", in, got, want)
		}
	}
	// A request that does not decode still names its job for the answer.
	if r, err := DecodeJobRequest([]byte(`{"id":"u1","color":"red","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`), "acme"); err == nil || r.ID != "u1" {
		t.Fatalf("DecodeJobRequest = %+v, %v; want an error and id u1", r, err)
	}
}

func TestDecoderBoundsNesting(t *testing.T) {
	deep := `{"id":"a","labels":{"x":` + strings.Repeat("[", 30000) + strings.Repeat("]", 30000) + `},"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`
	_, err := DecodeJobRequest([]byte(deep), "acme")
	ve, ok := errors.AsType[*ValidationError](err)
	if !ok || ve.Reason != ReasonInvalidJSON || !strings.Contains(ve.Error(), "nested more than") {
		t.Fatalf("DecodeJobRequest of a deep document = %v; want invalid_json, nested too deep", err)
	}
}

// BenchmarkDecodeJobRequest: what holding a request to its schema costs
// over encoding/json alone (the scheduler decodes every request).
func BenchmarkDecodeJobRequest(b *testing.B) {
	body := []byte(corpusCases[0].base)
	b.Run("strict", func(b *testing.B) {
		for b.Loop() {
			if _, err := DecodeJobRequest(body, "acme"); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding-json-only", func(b *testing.B) {
		for b.Loop() {
			var r JobRequest
			if err := json.Unmarshal(body, &r); err != nil {
				b.Fatal(err)
			}
			if err := r.Validate("acme"); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// hasDuplicateKey reports whether any object of a valid JSON document
// names a key twice; written apart from the decoder, as the oracle for
// what JSON Schema leaves unsaid.
func hasDuplicateKey(data []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(data))
	var walk func() bool
	walk = func() bool {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		d, ok := tok.(json.Delim)
		if !ok {
			return false
		}
		seen := map[string]bool{}
		dup := false
		for dec.More() {
			if d == '{' {
				k, _ := dec.Token()
				key, _ := k.(string)
				dup = dup || seen[key]
				seen[key] = true
			}
			dup = walk() || dup
		}
		_, _ = dec.Token()
		return dup
	}
	return walk()
}

// FuzzCancelRequestAgreesWithSchema: for any body, the decoder and an
// independent validator of cancel-request.json agree (a duplicated key
// counting as refused), with no rule beyond the schema in between.
func FuzzCancelRequestAgreesWithSchema(f *testing.F) {
	for _, s := range []string{`{"jobId":"a"}`, `{"jobId":"a","reason":"x","schemaVersion":1}`, `{"jobId":"a","jobId":"b"}`,
		`{"JobId":"a"}`, `{"jobId":null}`, `{"jobId":"a","schemaVersion":1.0}`, `{"jobId":"a","reason":"` + strings.Repeat("é", 1025) + `"}`, `null`, `[]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > MaxMessageBytes {
			return
		}
		sch := oracle(t, "cancel-request.json")
		inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
		schemaOK := err == nil && sch.Validate(inst) == nil && !hasDuplicateKey(data)
		_, decErr := DecodeCancelRequest(data)
		if schemaOK != (decErr == nil) {
			t.Fatalf("%q: schema accepts %v, decoder says %v", data, schemaOK, decErr)
		}
	})
}
