package contracts

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func validRequest() string {
	return `{"id":"train-1","name":"resnet","priority":"high","resources":{"gpu":{"count":2,"model":"H100-80GB","memoryMiB":40000}},"run":{"duration":"30s"}}`
}

func TestDecodeJobRequestAcceptsValid(t *testing.T) {
	tests := map[string]string{
		"full":              validRequest(),
		"minimal":           `{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`,
		"command":           `{"id":"a","resources":{"gpu":{"count":1}},"run":{"command":["sh","-c","true"],"env":{"A":"b"}}}`,
		"tenant matches":    `{"id":"a","tenant":"acme","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`,
		"duration fraction": `{"id":"a","resources":{"gpu":{"count":1,"model":"any"}},"run":{"duration":"2.5s"}}`,
		"schema version 1":  `{"schemaVersion":1,"id":"A_b-9","resources":{"gpu":{"count":64}},"run":{"duration":"1h"}}`,
		"best-effort class": `{"id":"a","priority":"best-effort","pool":"h100","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`,
		"image alone":       `{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox"}}`,
		"image by digest":   `{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"registry.example:5000/acme/train@sha256:` + strings.Repeat("ab", 32) + `"}}`,
		"image, everything": `{"id":"a","resources":{"gpu":{"count":1},"memoryMiB":4096},"run":{"image":"ghcr.io/acme/train:v3","command":["python"],"args":["train.py"],` +
			`"env":{"A":"1"},"workingDir":"/work","user":"1000:1000","shmSizeMiB":4096,"duration":"1h",` +
			`"mounts":[{"source":"/data/imagenet","target":"/data","readOnly":true},{"source":"/scratch/a","target":"/scratch"}]}}`,
		"image, args only":  `{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","args":["sleep","1"]}}`,
		"user by name":      `{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","user":"nobody:nogroup"}}`,
		"working dir /":     `{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","workingDir":"/"}}`,
		"host cmd and args": `{"id":"a","resources":{"gpu":{"count":1}},"run":{"command":["sh","-c"],"args":["true"]}}`,
	}
	for name, body := range tests {
		t.Run(name, func(t *testing.T) {
			if _, err := DecodeJobRequest([]byte(body), "acme"); err != nil {
				t.Fatalf("DecodeJobRequest: %v", err)
			}
		})
	}
}

// TestDecodeJobRequestRejectsWithSpecificReason is the catalogue of bad input:
// every malformed request gets one precise, machine-readable reason.
func TestDecodeJobRequestRejectsWithSpecificReason(t *testing.T) {
	tests := map[string]struct {
		body, tenant string
		reason       Reason
		field        string
	}{
		"empty body":         {``, "acme", ReasonEmptyBody, ""},
		"whitespace body":    {"  \n", "acme", ReasonEmptyBody, ""},
		"not json":           {`hello`, "acme", ReasonInvalidJSON, ""},
		"truncated":          {`{"id":"a"`, "acme", ReasonInvalidJSON, ""},
		"array":              {`[1,2]`, "acme", ReasonInvalidType, ""},
		"trailing garbage":   {validRequest() + `x`, "acme", ReasonInvalidJSON, ""},
		"two objects":        {validRequest() + validRequest(), "acme", ReasonInvalidJSON, ""},
		"count as string":    {`{"id":"a","resources":{"gpu":{"count":"2"}},"run":{"duration":"1s"}}`, "acme", ReasonInvalidType, "resources.gpu.count"},
		"count fractional":   {`{"id":"a","resources":{"gpu":{"count":1.5}},"run":{"duration":"1s"}}`, "acme", ReasonInvalidType, "resources.gpu.count"},
		"id as number":       {`{"id":7,"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonInvalidType, "id"},
		"unknown field":      {`{"id":"a","gpus":1,"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonUnknownField, "gpus"},
		"too large":          {`{"id":"a","name":"` + strings.Repeat("x", MaxMessageBytes) + `"}`, "acme", ReasonTooLarge, ""},
		"schema 99":          {`{"schemaVersion":99,"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonUnsupportedSchema, "schemaVersion"},
		"missing id":         {`{"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonMissingField, "id"},
		"id with dot":        {`{"id":"a.b","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonInvalidID, "id"},
		"id with star":       {`{"id":"a*","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonInvalidID, "id"},
		"id with gt":         {`{"id":"a>","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonInvalidID, "id"},
		"id with space":      {`{"id":"a b","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonInvalidID, "id"},
		"id too long":        {`{"id":"` + strings.Repeat("a", 129) + `","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonInvalidID, "id"},
		"tenant mismatch":    {`{"id":"a","tenant":"other","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonTenantMismatch, "tenant"},
		"bad subject tenant": {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "Acme", ReasonInvalidTenant, "tenant"},
		"unknown model":      {`{"id":"a","resources":{"gpu":{"count":1,"model":"RTX-9090"}},"run":{"duration":"1s"}}`, "acme", ReasonUnknownGPUModel, "resources.gpu.model"},
		"zero gpus":          {`{"id":"a","resources":{"gpu":{"count":0}},"run":{"duration":"1s"}}`, "acme", ReasonOutOfRange, "resources.gpu.count"},
		"absurd gpus":        {`{"id":"a","resources":{"gpu":{"count":100000}},"run":{"duration":"1s"}}`, "acme", ReasonOutOfRange, "resources.gpu.count"},
		"negative memory":    {`{"id":"a","resources":{"gpu":{"count":1,"memoryMiB":-1}},"run":{"duration":"1s"}}`, "acme", ReasonOutOfRange, "resources.gpu.memoryMiB"},
		"absurd memory":      {`{"id":"a","resources":{"gpu":{"count":1,"memoryMiB":99999999999}},"run":{"duration":"1s"}}`, "acme", ReasonOutOfRange, "resources.gpu.memoryMiB"},
		"bad duration":       {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"soon"}}`, "acme", ReasonInvalidDuration, "run.duration"},
		"duration as bool":   {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":true}}`, "acme", ReasonInvalidDuration, "run.duration"},
		"negative duration":  {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"-5s"}}`, "acme", ReasonInvalidDuration, "run.duration"},
		"endless duration":   {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"100000h"}}`, "acme", ReasonOutOfRange, "run.duration"},
		"missing run":        {`{"id":"a","resources":{"gpu":{"count":1}}}`, "acme", ReasonMissingField, "run"},
		"empty program":      {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"command":[""]}}`, "acme", ReasonInvalidValue, "run.command"},
		"env without cmd":    {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s","env":{"A":"b"}}}`, "acme", ReasonConflictingRun, "run.env"},
		"bad env name":       {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"command":["x"],"env":{"A=B":"c"}}}`, "acme", ReasonInvalidValue, "run.env"},
		"unknown priority":   {`{"id":"a","priority":"urgent","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonUnknownPriority, "priority"},
		"bad pool":           {`{"id":"a","pool":"H100.x","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "acme", ReasonInvalidValue, "pool"},
		"exit code 300":      {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s","exitCode":300}}`, "acme", ReasonOutOfRange, "run.exitCode"},
		"negative cpu":       {`{"id":"a","resources":{"gpu":{"count":1},"cpuMilli":-4},"run":{"duration":"1s"}}`, "acme", ReasonOutOfRange, "resources.cpuMilli"},
		// Containers (issue 14).
		"image not a ref":       {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"Not A Ref"}}`, "acme", ReasonImageInvalid, "run.image"},
		"image upper case":      {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"Acme/Train:v1"}}`, "acme", ReasonImageInvalid, "run.image"},
		"image bad digest":      {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox@sha256:abc"}}`, "acme", ReasonImageInvalid, "run.image"},
		"image bad tag":         {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox:"}}`, "acme", ReasonImageInvalid, "run.image"},
		"image spaces":          {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":" busybox"}}`, "acme", ReasonImageInvalid, "run.image"},
		"image with exitCode":   {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","exitCode":3}}`, "acme", ReasonConflictingRun, "run.exitCode"},
		"mounts without image":  {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"command":["x"],"mounts":[{"source":"/data","target":"/data"}]}}`, "acme", ReasonConflictingRun, "run.mounts"},
		"user without image":    {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"command":["x"],"user":"1000"}}`, "acme", ReasonConflictingRun, "run.user"},
		"shm without image":     {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"command":["x"],"shmSizeMiB":64}}`, "acme", ReasonConflictingRun, "run.shmSizeMiB"},
		"workdir without image": {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"command":["x"],"workingDir":"/w"}}`, "acme", ReasonConflictingRun, "run.workingDir"},
		"args without command":  {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s","args":["x"]}}`, "acme", ReasonConflictingRun, "run.args"},
		"relative source":       {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"data","target":"/data"}]}}`, "acme", ReasonInvalidValue, "run.mounts[0].source"},
		"dotdot source":         {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/data/../etc","target":"/data"}]}}`, "acme", ReasonInvalidValue, "run.mounts[0].source"},
		"relative target":       {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/data","target":"data"}]}}`, "acme", ReasonInvalidValue, "run.mounts[0].target"},
		"target is root":        {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/data","target":"/"}]}}`, "acme", ReasonInvalidValue, "run.mounts[0].target"},
		"mount onto /proc":      {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/data","target":"/proc"}]}}`, "acme", ReasonMountNotAllowed, "run.mounts[0].target"},
		"mount onto /dev/shm":   {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/data","target":"/dev/shm"}]}}`, "acme", ReasonMountNotAllowed, "run.mounts[0].target"},
		"mount host /sys":       {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/sys/fs","target":"/x"}]}}`, "acme", ReasonMountNotAllowed, "run.mounts[0].source"},
		"mount host /dev":       {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/dev","target":"/x"}]}}`, "acme", ReasonMountNotAllowed, "run.mounts[0].source"},
		"two mounts one target": {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","mounts":[{"source":"/a","target":"/x"},{"source":"/b","target":"/x"}]}}`, "acme", ReasonInvalidValue, "run.mounts[1].target"},
		"user bad format":       {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","user":"1000:1000:1"}}`, "acme", ReasonInvalidValue, "run.user"},
		"user upper case":       {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","user":"Root"}}`, "acme", ReasonInvalidValue, "run.user"},
		"shm negative":          {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","shmSizeMiB":-1}}`, "acme", ReasonOutOfRange, "run.shmSizeMiB"},
		"shm absurd":            {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","shmSizeMiB":2000000}}`, "acme", ReasonOutOfRange, "run.shmSizeMiB"},
		"shm over memory":       {`{"id":"a","resources":{"gpu":{"count":1},"memoryMiB":1024},"run":{"image":"busybox","shmSizeMiB":2048}}`, "acme", ReasonOutOfRange, "run.shmSizeMiB"},
		"workdir relative":      {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"image":"busybox","workingDir":"work"}}`, "acme", ReasonInvalidValue, "run.workingDir"},
		// null is a value of its own, refused where the schema does not allow it.
		"null resources gpu": {`{"id":"a","resources":{"gpu":null},"run":{"duration":"1s"}}`, "acme", ReasonInvalidType, "resources.gpu"},
		// The schema takes a duration as a string only.
		"duration seconds": {`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":2.5}}`, "acme", ReasonInvalidDuration, "run.duration"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeJobRequest([]byte(tt.body), tt.tenant)
			var verr *ValidationError
			if !errors.As(err, &verr) {
				t.Fatalf("err = %v, want a *ValidationError", err)
			}
			found := false
			for _, f := range verr.Fields {
				if f.Reason == tt.reason && f.Field == tt.field {
					found = true
				}
				if f.Message == "" {
					t.Errorf("field error %+v has no message", f)
				}
			}
			if !found {
				t.Fatalf("errors %v do not include %s on %q", verr.Fields, tt.reason, tt.field)
			}
		})
	}
}

func TestValidateReportsEveryProblemAtOnce(t *testing.T) {
	_, err := DecodeJobRequest([]byte(`{"id":"a.b","priority":"x","resources":{"gpu":{"count":0,"model":"nope"}}}`), "acme")
	var verr *ValidationError
	if !errors.As(err, &verr) {
		t.Fatalf("err = %v", err)
	}
	if verr.Reason != ReasonInvalidRequest || len(verr.Fields) != 5 {
		t.Fatalf("got reason %s with %d fields %v; want invalid_request with 5", verr.Reason, len(verr.Fields), verr.Fields)
	}
}

func TestNormalizedFillsDefaults(t *testing.T) {
	r, err := DecodeJobRequest([]byte(`{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"2s"}}`), "acme")
	if err != nil {
		t.Fatal(err)
	}
	n := r.Normalized("acme")
	if n.Tenant != "acme" || n.Priority != PriorityNormal || n.Resources.GPU.Model != GPUModelAny || n.SchemaVersion != SchemaVersion || n.Run.Duration.D() != 2*time.Second {
		t.Fatalf("Normalized = %+v", n)
	}
}

func TestDecodeCancelRequest(t *testing.T) {
	tests := map[string]struct {
		body   string
		reason Reason
	}{
		"valid":        {`{"jobId":"a"}`, ""},
		"bad id":       {`{"jobId":"a.b"}`, ReasonInvalidID},
		"missing id":   {`{}`, ReasonInvalidID},
		"not json":     {`{`, ReasonInvalidJSON},
		"unknown":      {`{"jobId":"a","x":1}`, ReasonUnknownField},
		"schema":       {`{"jobId":"a","schemaVersion":2}`, ReasonUnsupportedSchema},
		"reason large": {`{"jobId":"a","reason":"` + strings.Repeat("r", 2000) + `"}`, ReasonOutOfRange},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeCancelRequest([]byte(tt.body))
			if tt.reason == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			var verr *ValidationError
			if !errors.As(err, &verr) || verr.Fields[0].Reason != tt.reason {
				t.Fatalf("err = %v, want %s", err, tt.reason)
			}
		})
	}
}

func TestSubjectTokensAreValidatedIDs(t *testing.T) {
	for _, bad := range []string{"", "a.b", "a*", "a>", "a b", "-a", "a\x00"} {
		if ValidateID(bad) == nil {
			t.Errorf("ValidateID(%q) accepted a non-token", bad)
		}
	}
	for _, bad := range []string{"", "A", "a.b", "-a", "a-", strings.Repeat("a", 33)} {
		if ValidateTenant(bad) == nil {
			t.Errorf("ValidateTenant(%q) accepted", bad)
		}
	}
	if got, err := TenantFromSubject(SubjectSubmit("acme")); err != nil || got != "acme" {
		t.Errorf("TenantFromSubject(submit) = %q, %v", got, err)
	}
	if got, err := TenantFromSubject(SubjectJobEvents("acme", "j1")); err != nil || got != "acme" {
		t.Errorf("TenantFromSubject(events) = %q, %v", got, err)
	}
	if _, err := TenantFromSubject("gp.jobs.submit.BAD"); err == nil {
		t.Error("TenantFromSubject accepted an invalid tenant")
	}
}

// FuzzDecodeJobRequest: no input crashes the decoder, and whatever it
// accepts re-validates and normalizes to a request the scheduler can use.
func FuzzDecodeJobRequest(f *testing.F) {
	f.Add([]byte(validRequest()), "acme")
	f.Add([]byte(`{"id":"a","resources":{"gpu":{"count":1}},"run":{"command":["sh"]}}`), "t")
	f.Add([]byte(`{"run":{"duration":1e308}}`), "acme")
	f.Add([]byte(`null`), "acme")
	f.Fuzz(func(t *testing.T, data []byte, tenant string) {
		req, err := DecodeJobRequest(data, tenant)
		if err != nil {
			var verr *ValidationError
			if !errors.As(err, &verr) || len(verr.Fields) == 0 || verr.Reason == "" {
				t.Fatalf("error %v is not a ValidationError with reasons", err)
			}
			return
		}
		n := req.Normalized(tenant)
		if err := n.Validate(tenant); err != nil {
			t.Fatalf("normalized accepted request fails validation: %v", err)
		}
		if ValidateID(n.ID) != nil || ValidateTenant(tenant) != nil || n.Resources.GPU.Count < 1 {
			t.Fatalf("accepted request with unusable id/tenant/count: %+v", n)
		}
	})
}

func FuzzDecodeCancelRequest(f *testing.F) {
	f.Add([]byte(`{"jobId":"a"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := DecodeCancelRequest(data)
		if err == nil && ValidateID(c.JobID) != nil {
			t.Fatalf("accepted cancel with invalid job id %q", c.JobID)
		}
	})
}

// TestRejectionStaysSmall: however many problems a request has, its
// rejection lists at most MaxFieldErrors, in a stable order.
func TestRejectionStaysSmall(t *testing.T) {
	env := map[string]string{}
	for i := range 3000 { // about 40 KiB: under the body limit
		env[fmt.Sprintf("BAD=%d", i)] = "x"
	}
	body, _ := json.Marshal(JobRequest{ID: "a", Resources: Resources{GPU: GPURequest{Count: 1}},
		Run: RunSpec{Command: []string{"true"}, Env: env}})
	_, err1 := DecodeJobRequest(body, "acme")
	_, err2 := DecodeJobRequest(body, "acme")
	var v1, v2 *ValidationError
	if !errors.As(err1, &v1) || !errors.As(err2, &v2) {
		t.Fatalf("errors %v, %v", err1, err2)
	}
	if len(v1.Fields) != MaxFieldErrors {
		t.Fatalf("%d field errors, want %d", len(v1.Fields), MaxFieldErrors)
	}
	if fmt.Sprint(v1.Fields) != fmt.Sprint(v2.Fields) {
		t.Fatal("the same request was rejected with field errors in another order")
	}
	if enc, _ := json.Marshal(v1); len(enc) > MaxMessageBytes {
		t.Fatalf("rejection is %d bytes", len(enc))
	}
}

// TestLargestValidRequestFitsItsEvent: every field at its cap still makes a
// queued event within the body limit (the stream takes twice that), so an
// accepted request can always be answered. Raising a cap fails this test.
func TestLargestValidRequestFitsItsEvent(t *testing.T) {
	req := JobRequest{ID: strings.Repeat("i", 128), Name: strings.Repeat("n", MaxNameLength), Pool: "p",
		Resources: Resources{GPU: GPURequest{Count: 1}}, Labels: map[string]string{}, Run: RunSpec{Env: map[string]string{}}}
	arg := strings.Repeat("a", MaxCommandBytes/MaxCommandArgs)
	for range MaxCommandArgs {
		req.Run.Command = append(req.Run.Command, arg)
	}
	for i := range MaxEnvVars {
		req.Run.Env[fmt.Sprintf("E%03d", i)] = strings.Repeat("v", MaxEnvBytes/MaxEnvVars-4)
	}
	for i := range MaxLabels {
		req.Labels[fmt.Sprintf("l%03d", i)] = strings.Repeat("w", MaxLabelBytes-4)
	}
	body, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := DecodeJobRequest(body, "acme"); err != nil {
		t.Fatalf("the largest valid request is refused: %v", err)
	}
	ev, _ := json.Marshal(JobEvent{Type: EventQueued, Request: &req})
	if len(ev) > 2*MaxMessageBytes {
		t.Fatalf("its queued event is %d bytes, over the stream's %d", len(ev), 2*MaxMessageBytes)
	}
}

func TestNewJobIDIsAValidSubjectToken(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		id := NewJobID()
		if err := ValidateID(id); err != nil || len(id) != 26 || seen[id] {
			t.Fatalf("NewJobID() = %q: %v (duplicate=%v)", id, err, seen[id])
		}
		seen[id] = true
	}
}
