package deploy_test

import (
	"bufio"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// unit is a parsed systemd unit: section -> key -> values in order.
type unit map[string]map[string][]string

func (u unit) get(section, key string) string {
	v := u[section][key]
	if len(v) == 0 {
		return ""
	}
	return v[len(v)-1]
}

func parseUnit(t *testing.T, path string) unit {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	u := unit{}
	section := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";"):
		case strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]"):
			section = line[1 : len(line)-1]
			u[section] = map[string][]string{}
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok || section == "" {
				t.Fatalf("%s: %q", path, line)
			}
			u[section][k] = append(u[section][k], v)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return u
}

// serviceFlags returns the flag names a service registers: the first
// string literal of every fs.<Kind>(...) call in the RegisterFlags methods
// of its package and of libs/service (the bus flags every service has),
// and of every flag.<Kind>(...) call elsewhere (a main's own flags).
// Read from the source, so this module does not import the services.
func serviceFlags(t *testing.T, name string) map[string]bool {
	t.Helper()
	flags := map[string]bool{}
	src := filepath.Join("..", "services", name)
	if name == "fleet-sim" {
		// A command of the node agent's module, its flags in main.
		src = filepath.Join("..", "services", "node-agent", "cmd", "fleet-sim")
	}
	dirs := []string{src, filepath.Join("..", "libs", "service")}
	for _, dir := range dirs {
		fset := token.NewFileSet()
		pkgs, err := parser.ParseDir(fset, dir, func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, pkg := range pkgs {
			for _, file := range pkg.Files {
				for _, decl := range file.Decls {
					fn, ok := decl.(*ast.FuncDecl)
					if !ok || fn.Body == nil {
						continue
					}
					// fs.X in a RegisterFlags method, or the flag package's
					// own functions in a main.
					recv := "fs"
					if fn.Name.Name != "RegisterFlags" {
						recv = "flag"
					}
					ast.Inspect(fn.Body, func(n ast.Node) bool {
						call, ok := n.(*ast.CallExpr)
						if !ok {
							return true
						}
						if sel, ok := call.Fun.(*ast.SelectorExpr); !ok || !isIdent(sel.X, recv) || sel.Sel.Name == "Parse" {
							return true
						}
						for _, a := range call.Args {
							if lit, ok := a.(*ast.BasicLit); ok && lit.Kind == token.STRING {
								if s, err := strconv.Unquote(lit.Value); err == nil {
									flags[s] = true
								}
								break
							}
						}
						return true
					})
				}
			}
		}
	}
	if len(flags) < 5 {
		t.Fatalf("found only %d flags of %s: the RegisterFlags reader is out of date", len(flags), name)
	}
	return flags
}

func isIdent(e ast.Expr, name string) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == name
}

// TestSystemdUnits checks every unit of deploy/systemd: systemd-analyze
// verify accepts it (when this machine has systemd-analyze), ExecStart
// runs a gpuplane binary with flags that binary has, the creds come as a
// credential, the shared settings from gpuplane.env (three NATS URLs, R3),
// restarts are unconditional, and the sandbox is as strict as the process
// allows.
func TestSystemdUnits(t *testing.T) {
	paths, err := filepath.Glob("systemd/*.service")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"gpuplane-autoscaler", "gpuplane-billing", "gpuplane-gateway", "gpuplane-monitor",
		"gpuplane-node-agent", "gpuplane-resource-manager", "gpuplane-scheduler", "nats-server"}
	var got []string
	for _, p := range paths {
		got = append(got, strings.TrimSuffix(filepath.Base(p), ".service"))
	}
	if !slices.Equal(got, want) {
		t.Fatalf("units %v, want %v", got, want)
	}
	for _, p := range paths {
		t.Run(filepath.Base(p), func(t *testing.T) { checkUnit(t, p) })
	}
	env := readEnvFile(t, "systemd/gpuplane.env")
	if urls := strings.Split(env["GPUPLANE_NATS_URL"], ","); len(urls) != 3 {
		t.Errorf("gpuplane.env: %d NATS URLs, want the three servers", len(urls))
	}
	if env["GPUPLANE_STREAM_REPLICAS"] != "3" {
		t.Errorf("gpuplane.env: stream replicas %q, want 3", env["GPUPLANE_STREAM_REPLICAS"])
	}
	if env["GPUPLANE_NATS_CA"] == "" {
		t.Error("gpuplane.env: no NATS CA: the connection would not be TLS")
	}
	verifyUnits(t, paths)
}

func checkUnit(t *testing.T, path string) {
	u := parseUnit(t, path)
	name := strings.TrimSuffix(filepath.Base(path), ".service")
	svc := strings.TrimPrefix(name, "gpuplane-")
	if u.get("Service", "Restart") != "always" {
		t.Error("Restart is not always")
	}
	if u.get("Unit", "StartLimitIntervalSec") != "0" {
		t.Error("systemd gives up restarting after a burst of failures (StartLimitIntervalSec=0 missing)")
	}
	if u.get("Install", "WantedBy") != "multi-user.target" {
		t.Error("not wanted by multi-user.target")
	}
	if !strings.Contains(u.get("Unit", "After"), "network-online.target") {
		t.Error("does not start after the network is online")
	}
	exec := strings.Fields(u.get("Service", "ExecStart"))
	if len(exec) == 0 || exec[0] != "/opt/gpuplane/bin/"+svc {
		t.Fatalf("ExecStart %v, want /opt/gpuplane/bin/%s", exec, svc)
	}
	sandbox := map[string]string{"PrivateTmp": "yes", "ProtectKernelModules": "yes", "ProtectKernelTunables": "yes"}
	switch svc {
	case "nats-server":
		if !slices.Equal(exec[1:], []string{"-c", "/etc/gpuplane/nats-server.conf"}) {
			t.Errorf("ExecStart args %v", exec[1:])
		}
		conf, err := os.ReadFile("nats/nats-server.conf")
		if err != nil {
			t.Fatal(err)
		}
		if rw := u.get("Service", "ReadWritePaths"); !strings.Contains(string(conf), `store_dir: "`+rw+`"`) {
			t.Errorf("ReadWritePaths %q is not the config's store_dir", rw)
		}
		if u.get("Service", "User") != "gpuplane" {
			t.Error("nats-server does not run as the gpuplane user")
		}
		for _, f := range []string{"/etc/gpuplane/nats.env", "/etc/gpuplane/nats-key.env"} {
			if !slices.Contains(u["Service"]["EnvironmentFile"], f) {
				t.Errorf("EnvironmentFile %s missing", f)
			}
		}
		sandbox["ProtectSystem"], sandbox["NoNewPrivileges"], sandbox["CapabilityBoundingSet"] = "strict", "yes", ""
		if u.get("Service", "KillSignal") != "SIGUSR2" {
			t.Error("nats-server is not stopped in lame duck mode (KillSignal=SIGUSR2)")
		}
		if d, err := time.ParseDuration(u.get("Service", "TimeoutStopSec")); err != nil || d <= lameDuck {
			t.Errorf("TimeoutStopSec %q does not leave lame duck mode its %v", u.get("Service", "TimeoutStopSec"), lameDuck)
		}
	case "node-agent":
		// Root, a lighter sandbox (its runs inherit it), and runs that
		// outlive a restart of the agent: no private /tmp either, which
		// systemd would remove under them.
		if u.get("Service", "KillMode") != "process" {
			t.Error("KillMode is not process: restarting the agent would kill its runs")
		}
		if !slices.Contains(exec, "-backend=nvml") {
			t.Error("the node agent does not read the GPUs through NVML")
		}
		if sd := u.get("Service", "StateDirectory"); sd != "gpuplane" || !slices.Contains(exec, "-log-dir=/var/lib/gpuplane/runs") {
			t.Errorf("run state is not in the unit's StateDirectory (%q)", sd)
		}
		sandbox["ProtectSystem"], sandbox["PrivateTmp"] = "full", "no"
	default:
		sandbox["ProtectSystem"], sandbox["NoNewPrivileges"], sandbox["CapabilityBoundingSet"] = "strict", "yes", ""
		sandbox["DynamicUser"], sandbox["PrivateDevices"], sandbox["ProtectHome"] = "yes", "yes", "yes"
	}
	for k, v := range sandbox {
		if vals, ok := u["Service"][k]; !ok || vals[len(vals)-1] != v {
			t.Errorf("%s=%q, want %q", k, u.get("Service", k), v)
		}
	}
	if svc == "nats-server" {
		return
	}
	if u.get("Service", "EnvironmentFile") != "/etc/gpuplane/gpuplane.env" {
		t.Error("EnvironmentFile is not /etc/gpuplane/gpuplane.env")
	}
	creds := map[string]bool{}
	for _, lc := range u["Service"]["LoadCredential"] {
		id, path, _ := strings.Cut(lc, ":")
		creds[id] = true
		// The creds file gpuplane-creds mints for the identity of this
		// service's name and role (deploy/identities.yaml).
		if name, ok := strings.CutPrefix(path, "/etc/gpuplane/creds/"); ok {
			name = strings.TrimSuffix(name, ".creds")
			if role, ok := identities(t)[name]; !ok || name != svc || role != svc {
				t.Errorf("LoadCredential %s: want /etc/gpuplane/creds/%s.creds of an identity %s with role %s", lc, svc, svc, svc)
			}
		}
	}
	flags := serviceFlags(t, svc)
	for _, a := range exec[1:] {
		k, v, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !flags[k] {
			t.Errorf("%s has no flag -%s", svc, k)
		}
		if rest, ok := strings.CutPrefix(v, "%d/"); ok && !creds[rest] {
			t.Errorf("-%s reads credential %s, which no LoadCredential loads", k, rest)
		}
	}
	if !slices.Contains(exec, "-creds=%d/nats.creds") {
		t.Error("the service's NATS creds are not its credential nats.creds")
	}
}

// verifyUnits runs systemd-analyze verify on the units, with ExecStart's
// binaries stubbed under a temporary root (it checks they are
// executable). Any warning fails.
func verifyUnits(t *testing.T, paths []string) {
	t.Helper()
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Log("systemd-analyze not found: units checked by this test's parser only")
		return
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	var units []string
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(dir, filepath.Base(p))
		if err := os.WriteFile(out, []byte(strings.ReplaceAll(string(data), "/opt/gpuplane/bin/", bin+"/")), 0o644); err != nil {
			t.Fatal(err)
		}
		units = append(units, out)
		stub := filepath.Join(bin, strings.TrimPrefix(strings.TrimSuffix(filepath.Base(p), ".service"), "gpuplane-"))
		if err := os.WriteFile(stub, []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(sa, append([]string{"verify", "--man=no"}, units...)...)
	out, err := cmd.CombinedOutput()
	if err != nil || len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}
