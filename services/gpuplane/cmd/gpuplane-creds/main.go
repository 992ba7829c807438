// Command gpuplane-creds mints the bus credentials of an installation from
// its identities description (deploy/identities.yaml): a creds file per
// identity, and the nats-server configuration that trusts them (auth.conf,
// included by the server configs of deploy/ and the Tiltfile). The trust
// (the operator's and accounts' keys) is kept in -trust and reused, so a
// second run adds identities without invalidating the creds handed out.
//
//	go run ./services/gpuplane/cmd/gpuplane-creds -identities deploy/identities.yaml -trust .secrets/trust -out .secrets/creds
//	go run ./services/gpuplane/cmd/gpuplane-creds -trust .secrets/trust -out .secrets/creds -node gpu-01
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/tlsgen"
)

func main() {
	identities := flag.String("identities", "deploy/identities.yaml", "identities description (YAML)")
	trustDir := flag.String("trust", ".secrets/trust", "directory of the trust's keys (created when empty; keep it secret)")
	out := flag.String("out", ".secrets/creds", "directory to write <name>.creds and auth.conf into")
	node := flag.String("node", "", "mint only a node agent's creds for this node ID")
	tenant := flag.String("tenant", "", "mint only a tenant client's creds for this tenant")
	tlsHosts := flag.String("tls-hosts", "", "also make a CA and NATS and gateway certificates for these comma-separated hosts, into <out>/tls (kept if present)")
	flag.Parse()
	if err := run(*identities, *trustDir, *out, *node, *tenant); err != nil {
		fmt.Fprintln(os.Stderr, "gpuplane-creds:", err)
		os.Exit(1)
	}
	if *tlsHosts != "" {
		if err := makeTLS(filepath.Join(*out, "tls"), strings.Split(*tlsHosts, ",")); err != nil {
			fmt.Fprintln(os.Stderr, "gpuplane-creds:", err)
			os.Exit(1)
		}
	}
}

// makeTLS writes a CA and a certificate each for NATS (server, client and
// cluster routes) and the gateway, unless dir already has them: a second
// run must not invalidate what the running servers use.
func makeTLS(dir string, hosts []string) error {
	if _, err := os.Stat(filepath.Join(dir, "ca.pem")); err == nil {
		fmt.Println(dir + " (kept)")
		return nil
	}
	ca, err := tlsgen.NewCA("gpuplane CA", 5*365*24*time.Hour)
	if err != nil {
		return err
	}
	for _, name := range []string{"nats", "gateway"} {
		pair, err := ca.Issue(name, hosts, 365*24*time.Hour)
		if err != nil {
			return err
		}
		if err := ca.Write(dir, name, pair); err != nil {
			return err
		}
	}
	fmt.Println(dir)
	return nil
}

func run(identities, trustDir, out, node, tenant string) error {
	trust, err := natsauth.LoadOrCreate(trustDir)
	if err != nil {
		return err
	}
	var ids []contracts.Identity
	switch {
	case node != "":
		ids = append(ids, contracts.Identity{Name: "node-" + node, Role: contracts.BusNode, Scope: node})
	case tenant != "":
		ids = append(ids, contracts.Identity{Name: "tenant-" + tenant, Role: contracts.BusTenant, Scope: tenant})
	default:
		d, err := natsauth.LoadDescription(identities)
		if err != nil {
			return err
		}
		for _, row := range d.Identities {
			ids = append(ids, row.Identity())
		}
	}
	for _, id := range ids {
		p, err := trust.WriteCreds(out, id)
		if err != nil {
			return err
		}
		fmt.Println(p)
	}
	p, err := trust.WriteServerConfig(out)
	if err != nil {
		return err
	}
	fmt.Println(p)
	return nil
}
