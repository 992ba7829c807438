// Package e2e holds gpuplane's end-to-end tests: the whole platform started
// for real, driven through its public entry points (the bus and the REST
// API), and checked by an independent oracle (package oracle).
package e2e

import (
	"fmt"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// BadCase is one malformed job request and the reason it must be rejected
// with. ID is the unique job ID the body carries where it carries one: on
// the bus the rejection is published under it when the scheduler can read
// it, and under rej-<stream seq> otherwise.
type BadCase struct {
	Name   string
	Body   string
	ID     string
	Reason contracts.Reason
	// BusOnly cases are valid through the API, which fills in what a bus
	// client must give itself (a missing job ID).
	BusOnly bool
}

// BadCases returns at least 50 distinct malformed requests. Each
// case's ID is unique (prefix + index) so the rejections can be matched.
func BadCases(prefix string) []BadCase {
	var cs []BadCase
	add := func(name string, reason contracts.Reason, _ bool, body func(id string) string) {
		id := fmt.Sprintf("%s-%02d", prefix, len(cs))
		cs = append(cs, BadCase{Name: name, Body: body(id), ID: id, Reason: reason})
	}
	ok := func(id, extra string) string {
		// A valid request into which extra fields are spliced.
		return `{"id":"` + id + `","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}` + extra + `}`
	}
	gpu := func(id, gpuJSON string) string {
		return `{"id":"` + id + `","resources":{"gpu":` + gpuJSON + `},"run":{"duration":"1s"}}`
	}
	run := func(id, runJSON string) string {
		return `{"id":"` + id + `","resources":{"gpu":{"count":1}},"run":` + runJSON + `}`
	}
	// Not a JSON object at all: no usable ID.
	add("empty body", contracts.ReasonEmptyBody, false, func(string) string { return "" })
	add("whitespace", contracts.ReasonEmptyBody, false, func(string) string { return " \n\t " })
	add("plain text", contracts.ReasonInvalidJSON, false, func(string) string { return "please run my job" })
	add("truncated", contracts.ReasonInvalidJSON, false, func(id string) string { return `{"id":"` + id + `","resources":{` })
	add("array", contracts.ReasonInvalidType, false, func(string) string { return `[{"id":"x"}]` })
	add("number", contracts.ReasonInvalidType, false, func(string) string { return `42` })
	add("string", contracts.ReasonInvalidType, false, func(string) string { return `"job"` })
	add("trailing garbage", contracts.ReasonInvalidJSON, false, func(id string) string { return ok(id, "") + "}}" })
	add("two objects", contracts.ReasonInvalidJSON, false, func(id string) string { return ok(id, "") + ok(id, "") })
	add("single quotes", contracts.ReasonInvalidJSON, false, func(id string) string { return `{'id':'` + id + `'}` })
	add("too large", contracts.ReasonTooLarge, false, func(id string) string {
		return ok(id, `,"name":"`+strings.Repeat("x", contracts.MaxMessageBytes)+`"`)
	})
	add("id as number", contracts.ReasonInvalidType, false, func(string) string { return `{"id":12,"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}` })
	add("missing id", contracts.ReasonMissingField, false, func(string) string { return `{"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}` })
	cs[len(cs)-1].BusOnly = true
	add("id with dot", contracts.ReasonInvalidID, false, func(string) string { return ok("a.b", "") })
	add("id with star", contracts.ReasonInvalidID, false, func(string) string { return ok("a*", "") })
	add("id with gt", contracts.ReasonInvalidID, false, func(string) string { return ok("a>", "") })
	add("id with space", contracts.ReasonInvalidID, false, func(string) string { return ok("a b", "") })
	add("id with slash", contracts.ReasonInvalidID, false, func(string) string { return ok("a/b", "") })
	add("id too long", contracts.ReasonInvalidID, false, func(string) string { return ok(strings.Repeat("z", 129), "") })
	add("id unicode", contracts.ReasonInvalidID, false, func(string) string { return ok("jöb", "") })
	add("id leading dash", contracts.ReasonInvalidID, false, func(string) string { return ok("-a", "") })
	// Usable ID, bad content: the rejection lands on the job's own subject.
	add("unknown top field", contracts.ReasonUnknownField, false, func(id string) string { return ok(id, `,"gpus":4`) })
	add("unknown nested field", contracts.ReasonUnknownField, false, func(id string) string { return gpu(id, `{"count":1,"vram":8}`) })
	add("count as string", contracts.ReasonInvalidType, false, func(id string) string { return gpu(id, `{"count":"2"}`) })
	add("count fractional", contracts.ReasonInvalidType, false, func(id string) string { return gpu(id, `{"count":1.5}`) })
	add("count as bool", contracts.ReasonInvalidType, false, func(id string) string { return gpu(id, `{"count":true}`) })
	add("gpu as array", contracts.ReasonInvalidType, false, func(id string) string { return gpu(id, `[1]`) })
	add("labels as list", contracts.ReasonInvalidType, false, func(id string) string { return ok(id, `,"labels":["a"]`) })
	add("command as string", contracts.ReasonInvalidType, false, func(id string) string { return run(id, `{"command":"sh -c true"}`) })
	add("schema version 99", contracts.ReasonUnsupportedSchema, true, func(id string) string { return ok(id, `,"schemaVersion":99`) })
	add("tenant mismatch", contracts.ReasonTenantMismatch, true, func(id string) string { return ok(id, `,"tenant":"someone-else"`) })
	add("unknown model", contracts.ReasonUnknownGPUModel, true, func(id string) string { return gpu(id, `{"count":1,"model":"RTX-9090"}`) })
	add("model lower case", contracts.ReasonUnknownGPUModel, true, func(id string) string { return gpu(id, `{"count":1,"model":"h100"}`) })
	add("zero gpus", contracts.ReasonOutOfRange, true, func(id string) string { return gpu(id, `{"count":0}`) })
	add("negative gpus", contracts.ReasonOutOfRange, true, func(id string) string { return gpu(id, `{"count":-3}`) })
	add("absurd gpus", contracts.ReasonOutOfRange, true, func(id string) string { return gpu(id, `{"count":1000000}`) })
	add("negative memory", contracts.ReasonOutOfRange, true, func(id string) string { return gpu(id, `{"count":1,"memoryMiB":-1}`) })
	add("absurd memory", contracts.ReasonOutOfRange, true, func(id string) string { return gpu(id, `{"count":1,"memoryMiB":999999999999}`) })
	add("negative cpu", contracts.ReasonOutOfRange, true, func(id string) string {
		return `{"id":"` + id + `","resources":{"gpu":{"count":1},"cpuMilli":-1},"run":{"duration":"1s"}}`
	})
	add("absurd host memory", contracts.ReasonOutOfRange, true, func(id string) string {
		return `{"id":"` + id + `","resources":{"gpu":{"count":1},"memoryMiB":99999999999},"run":{"duration":"1s"}}`
	})
	add("missing run", contracts.ReasonMissingField, true, func(id string) string { return `{"id":"` + id + `","resources":{"gpu":{"count":1}}}` })
	add("empty run", contracts.ReasonMissingField, true, func(id string) string { return run(id, `{}`) })
	add("bad duration", contracts.ReasonInvalidDuration, false, func(id string) string { return run(id, `{"duration":"soon"}`) })
	add("duration as bool", contracts.ReasonInvalidDuration, false, func(id string) string { return run(id, `{"duration":false}`) })
	add("negative duration", contracts.ReasonInvalidDuration, true, func(id string) string { return run(id, `{"duration":"-1s"}`) })
	add("endless duration", contracts.ReasonOutOfRange, true, func(id string) string { return run(id, `{"duration":"87600h"}`) })
	add("empty program", contracts.ReasonInvalidValue, true, func(id string) string { return run(id, `{"command":[""]}`) })
	add("env without command", contracts.ReasonConflictingRun, true, func(id string) string { return run(id, `{"duration":"1s","env":{"A":"b"}}`) })
	add("bad env name", contracts.ReasonInvalidValue, true, func(id string) string { return run(id, `{"command":["true"],"env":{"A=B":"c"}}`) })
	add("exit code 256", contracts.ReasonOutOfRange, true, func(id string) string { return run(id, `{"duration":"1s","exitCode":256}`) })
	add("too many args", contracts.ReasonOutOfRange, true, func(id string) string {
		return run(id, `{"command":[`+strings.TrimSuffix(strings.Repeat(`"a",`, contracts.MaxCommandArgs+1), ",")+`]}`)
	})
	// Containers (issue 14): each rule its reason, on both paths.
	add("image not a reference", contracts.ReasonImageInvalid, true, func(id string) string { return run(id, `{"image":"Not:A:Ref"}`) })
	add("mount onto /proc", contracts.ReasonMountNotAllowed, true, func(id string) string {
		return run(id, `{"image":"busybox","mounts":[{"source":"/data","target":"/proc"}]}`)
	})
	add("mount without image", contracts.ReasonConflictingRun, true, func(id string) string {
		return run(id, `{"command":["true"],"mounts":[{"source":"/data","target":"/data"}]}`)
	})
	add("bad user", contracts.ReasonInvalidValue, true, func(id string) string { return run(id, `{"image":"busybox","user":"a:b:c"}`) })
	add("shm beyond memory", contracts.ReasonOutOfRange, true, func(id string) string {
		return `{"id":"` + id + `","resources":{"gpu":{"count":1},"memoryMiB":512},"run":{"image":"busybox","shmSizeMiB":1024}}`
	})
	add("unknown priority", contracts.ReasonUnknownPriority, true, func(id string) string { return ok(id, `,"priority":"urgent"`) })
	add("bad pool", contracts.ReasonInvalidValue, true, func(id string) string { return ok(id, `,"pool":"H100.pool"`) })
	add("name too long", contracts.ReasonOutOfRange, true, func(id string) string { return ok(id, `,"name":"`+strings.Repeat("n", contracts.MaxNameLength+1)+`"`) })
	add("several problems", contracts.ReasonInvalidRequest, true, func(id string) string {
		return `{"id":"` + id + `","priority":"x","resources":{"gpu":{"count":0,"model":"nope"}},"run":{"duration":"1s"}}`
	})
	return cs
}
