package bus

import (
	"encoding/json"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// The bus decodes with github.com/segmentio/encoding/json (Msg.Decode);
// every producer and SDK encodes with encoding/json. These tests hold the
// decoder to encoding/json: every message type of the contracts, filled
// in every field, decodes to what encoding/json decodes, and so do the
// inputs where decoders tend to differ (case, unknown fields, nulls,
// duplicates, numbers into any, invalid documents).

// messages are the contracts' types that travel on the bus.
var messages = []any{
	contracts.JobRequest{}, contracts.JobEvent{}, contracts.CancelRequest{}, contracts.Plan{}, contracts.LedgerEntry{},
	contracts.Allocation{}, contracts.RunEvent{}, contracts.NodeCommand{}, contracts.LogChunk{}, contracts.NodeInventory{},
	contracts.Heartbeat{}, contracts.Telemetry{}, contracts.NodeEvent{}, contracts.HealthEvent{}, contracts.UsageRecord{},
	contracts.ScaleDecision{}, contracts.Alert{}, contracts.MachineEvent{}, contracts.FleetEvent{}, contracts.OpsEvent{},
	contracts.Lease{}, contracts.PullProgress{}, contracts.AuditRecord{}, contracts.PriceBookDoc{}, contracts.BudgetDoc{},
	contracts.QuotaDoc{}, contracts.PoolDoc{}, contracts.NodeAdmin{}, contracts.Migration{}, contracts.JobStatus{},
}

func TestDecodeEqualsEncodingJSONOnEveryMessage(t *testing.T) {
	for _, proto := range messages {
		typ := reflect.TypeOf(proto)
		for seed := range 3 {
			t.Run(fmt.Sprintf("%s/%d", typ.Name(), seed), func(t *testing.T) {
				v := reflect.New(typ)
				fill(v.Elem(), seed, 0)
				data, err := json.Marshal(v.Interface())
				if err != nil {
					t.Fatalf("encode: %v", err)
				}
				want, got := reflect.New(typ), reflect.New(typ)
				wantErr := json.Unmarshal(data, want.Interface())
				gotErr := (&Msg{Data: data}).Decode(got.Interface())
				if (wantErr == nil) != (gotErr == nil) {
					t.Fatalf("encoding/json: %v, Decode: %v\n%s", wantErr, gotErr, data)
				}
				if diff := cmp.Diff(want.Interface(), got.Interface(), cmp.Exporter(func(reflect.Type) bool { return true })); diff != "" {
					t.Fatalf("Decode differs from encoding/json (-want +got):\n%s\n%s", diff, data)
				}
				// And what Decode read encodes to the same bytes: the
				// wire does not change for what a service passes on.
				again, err := json.Marshal(got.Interface())
				if err != nil || string(again) != string(data) {
					t.Fatalf("re-encoded %s (%v), want %s", again, err, data)
				}
			})
		}
	}
}

func TestDecodeEqualsEncodingJSONWhereDecodersDiffer(t *testing.T) {
	type inner struct {
		N int    `json:"n"`
		S string `json:"s,omitempty"`
	}
	type target struct {
		ID      string            `json:"id"`
		Count   int               `json:"count"`
		Ratio   float64           `json:"ratio"`
		Any     any               `json:"any"`
		Labels  map[string]string `json:"labels"`
		List    []inner           `json:"list"`
		Ptr     *inner            `json:"ptr"`
		At      time.Time         `json:"at"`
		D       contracts.Duration
		Skipped string          `json:"-"`
		Raw     json.RawMessage `json:"raw"`
	}
	for _, tc := range []struct{ name, doc string }{
		{"case-insensitive names", `{"ID":"a","COUNT":2,"Ratio":0.5,"d":"1s"}`},
		{"unknown fields", `{"id":"a","nope":{"x":[1,2,{"y":null}]},"count":1}`},
		{"nulls", `{"id":null,"count":null,"labels":null,"list":null,"ptr":null,"any":null}`},
		{"duplicate keys, the last wins", `{"id":"a","id":"b","count":1,"count":2}`},
		{"numbers into any", `{"any":[1,2.5,-3e2,12345678901234567890,{"k":true}]}`},
		{"unicode and escapes", `{"id":"\u00e9\ud83d\ude00\n\t\"\\\/<>&","labels":{"\u2028":"x"}}`},
		{"invalid UTF-8 in a string", "{\"id\":\"\xff\xfe\"}"},
		{"raw kept whole", `{"raw": {"a" : [1, 2]}}`},
		{"a time", `{"at":"2026-11-26T23:59:59.123456789+01:00"}`},
		{"a dash field", `{"-":"x","Skipped":"y"}`},
		{"pointer filled", `{"ptr":{"n":3,"s":"x"}}`},
		{"syntax error", `{"id":"a",}`},
		{"wrong type", `{"count":"three"}`},
		{"truncated", `{"id":"a"`},
		{"trailing garbage", `{"id":"a"} x`},
		{"an empty document", ``},
		{"a bad duration", `{"D":"forever"}`},
		{"a bad time", `{"at":"yesterday"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var want, got target
			wantErr := json.Unmarshal([]byte(tc.doc), &want)
			gotErr := (&Msg{Data: []byte(tc.doc)}).Decode(&got)
			if (wantErr == nil) != (gotErr == nil) {
				t.Fatalf("encoding/json: %v, Decode: %v", wantErr, gotErr)
			}
			if wantErr != nil {
				return // what a failed decode left behind is no one's to read
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Fatalf("Decode differs from encoding/json (-want +got):\n%s", diff)
			}
		})
	}
}

// fill sets every field v can hold to a value drawn from seed, deep
// enough for the contracts' nesting.
func fill(v reflect.Value, seed, depth int) {
	if depth > 6 || !v.CanSet() {
		return
	}
	if v.Type() == reflect.TypeOf(time.Time{}) {
		v.Set(reflect.ValueOf(time.Date(2026, 11, 26, 12, seed, 7, 123456789*(seed+1)%1e9, time.UTC)))
		return
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString(fmt.Sprintf("%s-%d é<&>", v.Type().Name(), seed))
	case reflect.Bool:
		v.SetBool(seed%2 == 0)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(int64(seed*37 + 3))
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(uint64(seed*41 + 5))
	case reflect.Float32, reflect.Float64:
		v.SetFloat(float64(seed)*1.25 + 0.1)
	case reflect.Pointer:
		p := reflect.New(v.Type().Elem())
		fill(p.Elem(), seed, depth+1)
		v.Set(p)
	case reflect.Slice:
		if v.Type().Elem().Kind() == reflect.Uint8 {
			v.SetBytes([]byte(fmt.Sprintf("bytes-%d", seed)))
			return
		}
		s := reflect.MakeSlice(v.Type(), 2, 2)
		for i := range 2 {
			fill(s.Index(i), seed+i, depth+1)
		}
		v.Set(s)
	case reflect.Map:
		m := reflect.MakeMap(v.Type())
		for i := range 2 {
			k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
			fill(k, seed+i, depth+1)
			fill(e, seed+i, depth+1)
			m.SetMapIndex(k, e)
		}
		v.Set(m)
	case reflect.Struct:
		for i := range v.NumField() {
			if v.Type().Field(i).IsExported() {
				fill(v.Field(i), seed+i, depth+1)
			}
		}
	case reflect.Interface:
		if v.NumMethod() == 0 {
			v.Set(reflect.ValueOf(fmt.Sprintf("any-%d", seed)))
		}
	}
}
