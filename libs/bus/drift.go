package bus

import (
	"maps"
	"reflect"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// The operator keeps streams and buckets at contracts' config, but sends
// an update only where something differs. An update that changes nothing
// is not free: in a cluster each is a meta-group proposal and an advisory,
// and on nats-server v2.15.2 a stream update races (a data race, found by
// -race in CI) with a consumer being created on the same stream at the
// same moment (fileStore.UpdateConfig writes the config that
// fileStore.ConsumerStore reads without the lock). Services create
// consumers all the time, and the operator connects while they run
// (gpuctl, a test, a provisioning job during an upgrade), so an update is
// sent only when one is due.

// streamDrift names the fields of got, the config a server returned, that
// differ from want, contracts' config; none when no update is due. Both
// are first brought to the server's defaults for what a config leaves
// zero, so a field contracts leaves to the server is not drift.
func streamDrift(want, got jetstream.StreamConfig) []string {
	return fieldsDiffering(normalStream(want), normalStream(got))
}

// kvStream is the backing stream nats.go makes for a bucket of config c
// (jetstream.prepareKeyValueConfig, nats.go v1.55.0), for a bucket that
// neither mirrors nor sources (contracts' buckets do neither). A bucket is
// compared as its stream, not through its status's KeyValueConfig: that
// view leaves out what a hand edit of the stream can break (max messages,
// rollups, direct gets, the discard policy, max consumers, subjects) and
// reads the history through a uint8.
func kvStream(c jetstream.KeyValueConfig) jetstream.StreamConfig {
	history := int64(1)
	if c.History > 0 {
		history = int64(c.History)
	}
	maxBytes, maxMsgSize := c.MaxBytes, c.MaxValueSize
	if maxBytes == 0 {
		maxBytes = -1
	}
	if maxMsgSize == 0 {
		maxMsgSize = -1
	}
	replicas := c.Replicas
	if replicas == 0 {
		replicas = 1
	}
	compression := jetstream.NoCompression
	if c.Compression {
		compression = jetstream.S2Compression
	}
	return jetstream.StreamConfig{
		Name:                   "KV_" + c.Bucket,
		Description:            c.Description,
		Subjects:               []string{"$KV." + c.Bucket + ".>"},
		MaxMsgsPerSubject:      history,
		MaxBytes:               maxBytes,
		MaxAge:                 c.TTL,
		MaxMsgSize:             maxMsgSize,
		Storage:                c.Storage,
		Replicas:               replicas,
		Placement:              c.Placement,
		AllowRollup:            true,
		DenyDelete:             true,
		Duplicates:             defaultDuplicates(c.TTL),
		MaxMsgs:                -1,
		MaxConsumers:           -1,
		AllowDirect:            true,
		RePublish:              c.RePublish,
		Compression:            compression,
		Discard:                jetstream.DiscardNew,
		AllowMsgTTL:            c.LimitMarkerTTL != 0,
		SubjectDeleteMarkerTTL: c.LimitMarkerTTL,
		Metadata:               c.Metadata,
	}
}

// normalStream applies nats-server's defaults (server/stream.go,
// checkStreamCfg) to what c leaves zero.
func normalStream(c jetstream.StreamConfig) jetstream.StreamConfig {
	c.Subjects = append([]string(nil), c.Subjects...)
	if len(c.Subjects) == 0 {
		c.Subjects = nil
	}
	if c.MaxMsgs == 0 {
		c.MaxMsgs = -1
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = -1
	}
	if c.MaxMsgsPerSubject == 0 {
		c.MaxMsgsPerSubject = -1
	}
	if c.MaxMsgSize == 0 {
		c.MaxMsgSize = -1
	}
	if c.MaxConsumers == 0 {
		c.MaxConsumers = -1
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.Duplicates == 0 {
		c.Duplicates = defaultDuplicates(c.MaxAge)
	}
	c.Metadata = ownMetadata(c.Metadata)
	return c
}

// defaultDuplicates is the server's duplicate window for a stream that
// sets none: two minutes, or its max age when that is shorter.
func defaultDuplicates(maxAge time.Duration) time.Duration {
	const window = 2 * time.Minute
	if maxAge > 0 && maxAge < window {
		return maxAge
	}
	return window
}

// ownMetadata drops the keys the server adds itself (_nats.ver,
// _nats.level, _nats.req.level): they are not ours to keep.
func ownMetadata(m map[string]string) map[string]string {
	own := maps.Clone(m)
	maps.DeleteFunc(own, func(k, _ string) bool { return strings.HasPrefix(k, "_nats.") })
	if len(own) == 0 {
		return nil
	}
	return own
}

// fieldsDiffering names the exported fields of two structs of one type
// that are not deeply equal. Reflection keeps the comparison whole as
// nats.go adds fields to its configs.
func fieldsDiffering[T any](a, b T) []string {
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	var out []string
	for i := range va.NumField() {
		f := va.Type().Field(i)
		if !f.IsExported() {
			continue
		}
		if !reflect.DeepEqual(va.Field(i).Interface(), vb.Field(i).Interface()) {
			out = append(out, f.Name)
		}
	}
	return out
}
