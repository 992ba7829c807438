// Command gpuplane-probe is the exec probe of the services that serve no
// HTTP (scheduler, resource manager, autoscaler, billing, node agent). The
// images are distroless (no shell), so the probe is a binary of its own,
// shipped in every image:
//
//	gpuplane-probe bus -nats URLS -creds FILE -nats-ca FILE
//	    readiness: this pod reaches the NATS cluster, over TLS 1.3 with
//	    its own identity, within -timeout. A pod cut off from the bus is
//	    not ready, so a PodDisruptionBudget does not count it as healthy
//	    and a rolling update waits for it.
//	gpuplane-probe running [-pid 1]
//	    liveness: the service (PID 1 of its container) is neither stopped
//	    (SIGSTOP, a frozen cgroup) nor a zombie. A NATS outage must not
//	    restart every pod, so liveness does not look at the bus.
//
// The bus flags read the same environment variables as the services'.
package main

import (
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: gpuplane-probe bus|running [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "bus":
		err = busProbe(os.Args[2:])
	case "running":
		err = runningProbe(os.Args[2:])
	default:
		err = fmt.Errorf("unknown probe %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gpuplane-probe:", err)
		os.Exit(1)
	}
}

func busProbe(args []string) error {
	fs := flag.NewFlagSet("bus", flag.ContinueOnError)
	url := fs.String("nats", envOr("GPUPLANE_NATS_URL", "nats://127.0.0.1:4222"), "NATS URLs, comma-separated")
	creds := fs.String("creds", os.Getenv("GPUPLANE_NATS_CREDS"), "creds file of this pod's identity")
	ca := fs.String("nats-ca", os.Getenv("GPUPLANE_NATS_CA"), "CA (PEM) of the NATS servers; TLS 1.3 when set")
	timeout := fs.Duration("timeout", 3*time.Second, "how long to wait for the server's PONG")
	if err := fs.Parse(args); err != nil {
		return err
	}
	opts := []nats.Option{nats.Name("gpuplane-probe"), nats.Timeout(*timeout), nats.MaxReconnects(0), nats.NoCallbacksAfterClientClose()}
	if *creds != "" {
		opts = append(opts, nats.UserCredentials(*creds))
	}
	if *ca != "" {
		opts = append(opts, nats.Secure(&tls.Config{MinVersion: tls.VersionTLS13}), nats.RootCAs(*ca))
	}
	nc, err := nats.Connect(*url, opts...)
	if err != nil {
		return fmt.Errorf("bus: connect: %w", err)
	}
	defer nc.Close()
	if err := nc.FlushTimeout(*timeout); err != nil {
		return fmt.Errorf("bus: round trip: %w", err)
	}
	return nil
}

func runningProbe(args []string) error {
	fs := flag.NewFlagSet("running", flag.ContinueOnError)
	pid := fs.Int("pid", 1, "process to check")
	proc := fs.String("proc", "/proc", "procfs mount")
	if err := fs.Parse(args); err != nil {
		return err
	}
	data, err := os.ReadFile(fmt.Sprintf("%s/%d/stat", *proc, *pid))
	if err != nil {
		return fmt.Errorf("running: %w", err)
	}
	state, err := procState(string(data))
	if err != nil {
		return fmt.Errorf("running: pid %d: %w", *pid, err)
	}
	switch state {
	case 'T', 't':
		return fmt.Errorf("running: pid %d is stopped", *pid)
	case 'Z', 'X', 'x':
		return fmt.Errorf("running: pid %d is dead (%c)", *pid, state)
	}
	return nil
}

// procState is the state letter of a /proc/PID/stat line: the field after
// the command name, which is in parentheses and may itself hold spaces
// and parentheses (so the last ')' ends it).
func procState(stat string) (byte, error) {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 || i+2 >= len(stat) {
		return 0, errors.New("malformed stat")
	}
	return stat[i+2], nil
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
