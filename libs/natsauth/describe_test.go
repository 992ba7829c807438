package natsauth

import (
	"os"
	"testing"
)

// TestDeployIdentitiesIsTheDefault: deploy/identities.yaml, which deploy/
// and the Tiltfile mint credentials from, is the description `make run`
// uses when no file is given.
func TestDeployIdentitiesIsTheDefault(t *testing.T) {
	data, err := os.ReadFile("../../deploy/identities.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if string(data) != DefaultIdentitiesYAML {
		t.Fatal("deploy/identities.yaml and DefaultIdentitiesYAML differ; keep them the same")
	}
	d := DefaultDescription()
	for _, name := range []string{"operator", "admin", "tenant-acme", "scheduler", "fleet"} {
		if _, ok := d.Find(name); !ok {
			t.Errorf("default identities lack %s", name)
		}
	}
}

func TestParseDescriptionRefuses(t *testing.T) {
	tests := map[string]string{
		"unknown role":    "identities:\n  - {name: x, role: root}\n",
		"unknown field":   "identities:\n  - {name: x, role: scheduler, power: all}\n",
		"twice":           "identities:\n  - {name: x, role: scheduler}\n  - {name: x, role: billing}\n",
		"tenant unscoped": "identities:\n  - {name: t, role: tenant}\n",
		"empty":           "identities: []\n",
	}
	for name, y := range tests {
		if _, err := ParseDescription([]byte(y)); err == nil {
			t.Errorf("%s: parsed", name)
		}
	}
}

// TestTrustRoundTrip: a saved trust loads with the same keys, so a
// restarted `make run` keeps the creds it handed out valid.
func TestTrustRoundTrip(t *testing.T) {
	dir := t.TempDir()
	a, err := LoadOrCreate(dir)
	if err != nil {
		t.Fatal(err)
	}
	b, err := LoadOrCreate(dir)
	if err != nil {
		t.Fatal(err)
	}
	if a.AccountPublicKey() != b.AccountPublicKey() || a.SystemAccountPublicKey() != b.SystemAccountPublicKey() {
		t.Fatal("the reloaded trust has other keys")
	}
	info, err := os.Stat(dir + "/account.nk")
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Perm() != 0o600 {
		t.Fatalf("account seed mode %v, want 0600", info.Mode().Perm())
	}
	conf, err := a.ServerConfig()
	if err != nil || len(conf) < 100 {
		t.Fatalf("server config: %v (%d bytes)", err, len(conf))
	}
}
