package bus

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestStreamDrift: what the server fills in for a field a config leaves
// zero is not drift; a field an operator changed by hand is, by name.
func TestStreamDrift(t *testing.T) {
	want := jetstream.StreamConfig{Name: "JOBS", Subjects: []string{"a.>"}, MaxMsgs: -1, MaxAge: 0,
		DenyPurge: true, Metadata: map[string]string{"owner": "gpuplane"}}
	defaulted := want
	defaulted.MaxBytes, defaulted.MaxMsgsPerSubject, defaulted.MaxMsgSize, defaulted.MaxConsumers = -1, -1, -1, -1
	defaulted.Replicas, defaulted.Duplicates = 1, 2*time.Minute
	defaulted.Metadata = map[string]string{"owner": "gpuplane", "_nats.ver": "2.15.2", "_nats.level": "2", "_nats.req.level": "0"}
	shortAge := jetstream.StreamConfig{Name: "HB", MaxAge: 30 * time.Second}
	shortAgeDefaulted := shortAge
	shortAgeDefaulted.Duplicates = 30 * time.Second
	edit := func(f func(*jetstream.StreamConfig)) jetstream.StreamConfig {
		c := defaulted
		c.Subjects = slices.Clone(want.Subjects)
		f(&c)
		return c
	}
	for _, tc := range []struct {
		name      string
		want, got jetstream.StreamConfig
		drift     []string
	}{
		{"the server's defaults", want, defaulted, nil},
		{"a short max age's duplicate window", shortAge, shortAgeDefaulted, nil},
		{"max age set by hand", want, edit(func(c *jetstream.StreamConfig) { c.MaxAge = time.Hour }), []string{"MaxAge"}},
		{"deny purge turned off", want, edit(func(c *jetstream.StreamConfig) { c.DenyPurge = false }), []string{"DenyPurge"}},
		{"a subject added", want, edit(func(c *jetstream.StreamConfig) { c.Subjects = append(c.Subjects, "b.>") }), []string{"Subjects"}},
		{"replicas and our metadata", want, edit(func(c *jetstream.StreamConfig) {
			c.Replicas = 3
			c.Metadata = map[string]string{"_nats.ver": "2.15.2"}
		}), []string{"Replicas", "Metadata"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := streamDrift(tc.want, tc.got); !slices.Equal(got, tc.drift) {
				t.Errorf("streamDrift = %v, want %v", got, tc.drift)
			}
		})
	}
}
