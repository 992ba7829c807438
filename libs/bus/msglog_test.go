package bus

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestMsgLogNamesTheMessage: a message's logger carries its subject and
// stream sequence, then the handler's own attributes, in that order.
func TestMsgLogNamesTheMessage(t *testing.T) {
	for name, tc := range map[string]struct {
		args []any
		want map[string]any
	}{
		"message alone": {nil, map[string]any{"subject": "gp.alloc.ledger.n1", "stream_seq": float64(42)}},
		"with the handler's own": {[]any{"node_id", "n1"},
			map[string]any{"subject": "gp.alloc.ledger.n1", "stream_seq": float64(42), "node_id": "n1"}},
	} {
		t.Run(name, func(t *testing.T) {
			var buf bytes.Buffer
			base := slog.New(slog.NewJSONHandler(&buf, nil))
			m := &Msg{Subject: "gp.alloc.ledger.n1", StreamSeq: 42}
			m.Log(base, tc.args...).Info("x")
			var got map[string]any
			if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
				t.Fatal(err)
			}
			for _, k := range []string{"time", "level", "msg"} {
				delete(got, k)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("attributes (-want +got):\n%s", diff)
			}
		})
	}
}
