package gpuplane

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

func TestWriteNATSContexts(t *testing.T) {
	dir := t.TempDir()
	ep := Endpoints{NATSURL: "nats://127.0.0.1:4222", Creds: map[string]string{
		"tenant-acme": "/d/creds/tenant-acme.creds", "admin": "/d/creds/admin.creds", "operator": "/d/creds/operator.creds"}}
	wrote, err := WriteNATSContexts(dir, ep)
	if err != nil {
		t.Fatal(err)
	}
	if len(wrote) != 3 {
		t.Fatalf("wrote %v, want 3 contexts", wrote)
	}
	data, err := os.ReadFile(filepath.Join(dir, "gpuplane-acme.json"))
	if err != nil {
		t.Fatal(err)
	}
	var c natsContext
	if err := json.Unmarshal(data, &c); err != nil {
		t.Fatal(err)
	}
	want := natsContext{Description: "gpuplane make run as tenant-acme", URL: ep.NATSURL,
		Creds: "/d/creds/tenant-acme.creds", InboxPrefix: "_INBOX.tenant-acme"}
	if c != want {
		t.Fatalf("context %+v, want %+v", c, want)
	}
	info, err := os.Stat(filepath.Join(dir, "gpuplane-acme.json"))
	if err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("context file mode: %v %v", info.Mode(), err)
	}
}
