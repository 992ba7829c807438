package wire

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// batch is a telemetry batch as a node agent writes it.
func batch() contracts.Telemetry {
	at := time.Date(2026, 11, 22, 6, 32, 48, 123456789, time.FixedZone("x", 3600))
	return contracts.Telemetry{SchemaVersion: 1, NodeID: "n1", Hostname: "host-1", Pool: "h100", Time: at,
		GPUs: []contracts.GPUSample{
			{Index: 0, UUID: "GPU-0", Model: "H100-80GB", GPUUtil: 87.25, MemCopyUtil: 40.5, FBUsedMiB: 61440,
				FBFreeMiB: 20480, TempC: 64, PowerW: 512.25, SMClockMHz: 1980, PowerLimitW: 700, ECCSBE: 3, ECCDBE: 1,
				ThrottleReasons: contracts.ThrottleHWThermal | contracts.ThrottleSWPowerCap, LastXID: 48,
				Processes: []contracts.GPUProcess{{PID: 4242, UsedMiB: 61000}, {PID: 7, UsedMiB: 1}},
				Healthy:   true, AllocationID: "acme/j1/1"},
			{Index: 1, UUID: "GPU-1", Model: "H100-80GB", FBFreeMiB: 81920, TempC: 31, PowerW: 70, SMClockMHz: 210},
		}}
}

// seeds are inputs the fast path takes and inputs it must hand to
// encoding/json; every one runs in the normal tests through the fuzz
// target's seed corpus.
func seeds(t testing.TB) []string {
	full, err := json.Marshal(batch())
	if err != nil {
		t.Fatal(err)
	}
	pretty, err := json.MarshalIndent(batch(), "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	return []string{
		string(full),
		string(pretty),
		`{}`, `null`, ` {"gpus":[]} `, `{"gpus":null}`, `{"gpus":[{}]}`, `{"gpus":[null]}`,
		`{"gpus":[{"processes":[]}]}`, `{"gpus":[{"processes":null,"healthy":null}]}`,
		// Unknown keys of every shape are skipped.
		`{"extra":{"a":[1,-2.5e3,true,false,null,"s\"\\\/\b\f\n\r\t\u00e9"]},"nodeId":"n"}`,
		// Case-insensitive and repeated keys: encoding/json's rules.
		`{"NODEID":"n","nodeid":"m"}`, `{"nodeId":"a","nodeId":"b"}`, `{"ſchemaVersion":3}`,
		`{"gpus":[{"index":1,"uuid":"a"}],"gpus":[{"model":"x"}]}`,
		`{"gpus":[{"uuid":"a"},{"uuid":"b"}],"gpus":[{"model":"x"}],"gpus":[{},{}]}`,
		// Strings: escapes, UTF-8, invalid UTF-8, HTML escapes json.Marshal writes.
		`{"hostname":"h\u00e9\ud83d\ude00"}`, `{"hostname":"hé"}`, "{\"hostname\":\"h\xff\"}",
		`{"hostname":"\u003cb\u003e\u0026"}`, `{"hostname":"\ud800"}`,
		// Numbers at and past the edges of their fields.
		`{"schemaVersion":-0}`, `{"schemaVersion":9223372036854775807}`, `{"schemaVersion":9223372036854775808}`,
		`{"schemaVersion":1.0}`, `{"schemaVersion":1e2}`, `{"gpus":[{"gpuUtil":1e400}]}`,
		`{"gpus":[{"gpuUtil":-0.0,"tempC":1E+2,"powerW":2.5e-3}]}`, `{"gpus":[{"throttleReasons":18446744073709551615}]}`,
		`{"gpus":[{"throttleReasons":-1}]}`, `{"schemaVersion":01}`, `{"schemaVersion":-}`, `{"schemaVersion":1.}`,
		// Wrong types, times and syntax.
		`{"nodeId":1}`, `{"schemaVersion":"1"}`, `{"gpus":{}}`, `{"gpus":[1]}`, `{"gpus":[{"healthy":1}]}`,
		`{"time":"2026-01-02T03:04:05Z"}`, `{"time":"2026-01-02"}`, `{"time":null}`, `{"time":5}`,
		`{"nodeId":"a",}`, `{"nodeId":"a"} x`, `{"nodeId":"a"`, `[]`, ``, `{"a":tru}`, "{\"a\":\"\x01\"}",
		`{"a":"\x"}`, `{"a":"\u12"}`, `{"nodeId" "a"}`, `{nodeId:"a"}`, `{"gpus":[{"index":1}`,
		strings.Repeat(`{"a":`, 600) + `1` + strings.Repeat(`}`, 600),
	}
}

func FuzzDecodeTelemetry(f *testing.F) {
	for _, s := range seeds(f) {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		checkSame(t, data)
	})
}

var fuzzDecoder Decoder

// checkSame asserts DecodeTelemetry gives what encoding/json gives: the same
// value, or an error for the same inputs.
func checkSame(t *testing.T, data []byte) {
	t.Helper()
	var want contracts.Telemetry
	wantErr := json.Unmarshal(data, &want)
	got, err := DecodeTelemetry(data)
	// A Decoder that has seen other batches shares strings, and must
	// decode the same.
	shared, sharedErr := fuzzDecoder.Decode(data)
	if (sharedErr != nil) != (err != nil) || (err == nil && !reflect.DeepEqual(shared, got)) {
		t.Fatalf("shared Decoder gave %+v, %v; DecodeTelemetry %+v, %v", shared, sharedErr, got, err)
	}
	switch {
	case (err != nil) != (wantErr != nil):
		t.Fatalf("DecodeTelemetry(%q) error = %v, encoding/json's = %v", data, err, wantErr)
	case err != nil:
		if !strings.HasPrefix(err.Error(), "telemetry batch: ") || !strings.Contains(err.Error(), wantErr.Error()) {
			t.Fatalf("DecodeTelemetry(%q) error = %q, want encoding/json's %q wrapped", data, err, wantErr)
		}
	case !reflect.DeepEqual(got, want):
		// DeepEqual also tells a nil slice from an empty one.
		t.Fatalf("DecodeTelemetry(%q) differs from encoding/json (-json +ours):\n%s", data, cmp.Diff(want, got))
	}
}

// TestFastPathTakesAgentBatches checks that what agents write never needs
// encoding/json: the speed-up must hold for real traffic, not only be
// correct.
func TestFastPathTakesAgentBatches(t *testing.T) {
	for name, v := range map[string]contracts.Telemetry{"full": batch(), "empty": {}, "no gpus": {GPUs: []contracts.GPUSample{}}} {
		data, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		var got contracts.Telemetry
		d := decoder{data: data}
		if !d.telemetry(&got) {
			t.Errorf("%s: fast path refused %s", name, data)
		}
		var want contracts.Telemetry
		if err := json.Unmarshal(data, &want); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: fast path (-json +fast):\n%s", name, cmp.Diff(want, got))
		}
	}
}

func TestDecodeTelemetryErrorsAreClear(t *testing.T) {
	for name, tc := range map[string]struct {
		in, want string
	}{
		"truncated":  {`{"nodeId":"a"`, "telemetry batch: unexpected end of JSON input"},
		"wrong type": {`{"gpus":[{"index":"0"}]}`, "telemetry batch: json: cannot unmarshal string into Go struct field"},
		"not json":   {`hello`, "telemetry batch: invalid character 'h'"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeTelemetry([]byte(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("DecodeTelemetry(%q) = %v, want an error containing %q", tc.in, err, tc.want)
			}
		})
	}
}

// BenchmarkDecodeTelemetry compares the decoder with encoding/json on the
// same 8-GPU batch, in the same run: the ratio is the speed-up.
func BenchmarkDecodeTelemetry(b *testing.B) {
	v := batch()
	v.GPUs = nil
	for i := range 8 {
		v.GPUs = append(v.GPUs, contracts.GPUSample{Index: i, UUID: "GPU-1b6f7e0a-64c4-4d8e-9b1f-0000000000" + string(rune('0'+i)) + "0",
			Model: "H100-80GB", GPUUtil: 87, MemCopyUtil: 40.5, FBUsedMiB: 40000, FBFreeMiB: 41920, TempC: 60,
			PowerW: 400.25, SMClockMHz: 1980, PowerLimitW: 700, Healthy: true, AllocationID: "acme/j1/1"})
	}
	data, err := json.Marshal(v)
	if err != nil {
		b.Fatal(err)
	}
	for _, dec := range []struct {
		name string
		fn   func([]byte) (contracts.Telemetry, error)
	}{
		{"encoding-json", func(d []byte) (contracts.Telemetry, error) {
			var t contracts.Telemetry
			err := json.Unmarshal(d, &t)
			return t, err
		}},
		{"wire", DecodeTelemetry},
		{"wire-interned", new(Decoder).Decode},
	} {
		b.Run(dec.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(data)))
			for b.Loop() {
				t, err := dec.fn(data)
				if err != nil || len(t.GPUs) != 8 {
					b.Fatalf("decoded %d GPUs, err %v", len(t.GPUs), err)
				}
			}
			b.ReportMetric(float64(b.N*8)/b.Elapsed().Seconds(), "samples/s")
		})
	}
}
