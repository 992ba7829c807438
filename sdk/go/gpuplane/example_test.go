package gpuplane_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// These examples run, as tests, against the embedded stack that
// main_test.go starts: gatewayURL is its gateway, demoToken an API token of
// a member of tenant acme, adminToken one of a platform admin. Against a
// real platform, use its URL and your token (gpuctl token create), or
// gpuplane.DefaultTokenSource to use gpuctl's login.

// Submit a job and wait for it to end.
func Example() {
	ctx := context.Background()
	c, err := gpuplane.New(gatewayURL, gpuplane.WithToken(demoToken))
	if err != nil {
		log.Fatal(err)
	}
	res, err := c.Submit(ctx, "acme", contracts.JobRequest{
		ID:        "example-train-1",
		Name:      "resnet",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 2, Model: "L4"}},
		// A simulated run of one second; Command runs a program instead.
		Run: contracts.RunSpec{Duration: contracts.Duration(time.Second)},
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("submitted", res.JobID)
	st, err := c.Wait(ctx, "acme", res.JobID)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(st.JobID, st.State, "on", len(st.Placement.Devices), "GPUs")
	// Output:
	// submitted example-train-1
	// example-train-1 succeeded on 2 GPUs
}

// A submit is idempotent through its job ID: sending the same request
// again (a retry after a lost answer) is the same job, not a second one.
func ExampleClient_Submit() {
	ctx := context.Background()
	c, err := gpuplane.New(gatewayURL, gpuplane.WithToken(demoToken))
	if err != nil {
		log.Fatal(err)
	}
	req := contracts.JobRequest{
		ID:        "example-once",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(time.Second)},
	}
	for range 2 {
		res, err := c.Submit(ctx, "acme", req)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(res.JobID, "duplicate:", res.Duplicate)
	}
	// Output:
	// example-once duplicate: false
	// example-once duplicate: true
}

// Follow a job's events as they happen; the sequence ends with the event
// that ends the job, and survives broken connections.
func ExampleClient_Watch() {
	ctx := context.Background()
	c, err := gpuplane.New(gatewayURL, gpuplane.WithToken(demoToken))
	if err != nil {
		log.Fatal(err)
	}
	_, err = c.Submit(ctx, "acme", contracts.JobRequest{
		ID:        "example-watch",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(time.Second), ExitCode: 3},
	})
	if err != nil {
		log.Fatal(err)
	}
	for ev, err := range c.Watch(ctx, "acme", "example-watch", gpuplane.WatchOptions{}) {
		if err != nil {
			log.Fatal(err)
		}
		if ev.Event.Type == contracts.EventPending {
			continue // still queued, waiting for GPUs: ev.Event.Reason says why
		}
		line := string(ev.Event.Type)
		if ev.Event.ExitCode != nil {
			line += fmt.Sprintf(" (exit %d)", *ev.Event.ExitCode)
		}
		fmt.Println(line)
	}
	// Output:
	// queued
	// scheduled
	// running
	// failed (exit 3)
}

// Read a run's output as it is written, to its end.
func ExampleClient_Logs() {
	ctx := context.Background()
	c, err := gpuplane.New(gatewayURL, gpuplane.WithToken(demoToken))
	if err != nil {
		log.Fatal(err)
	}
	_, err = c.Submit(ctx, "acme", contracts.JobRequest{
		ID:        "example-logs",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}},
		Run:       contracts.RunSpec{Command: []string{"sh", "-c", "echo epoch 1; echo epoch 2"}},
	})
	if err != nil {
		log.Fatal(err)
	}
	// Follow waits for the job to start, and ends with its run.
	out, err := c.Logs(ctx, "acme", "example-logs", gpuplane.LogOptions{Follow: true})
	if err != nil {
		log.Fatal(err)
	}
	defer out.Close()
	if _, err := io.Copy(os.Stdout, out); err != nil {
		log.Fatal(err)
	}
	code, _ := out.ExitCode()
	fmt.Println("complete:", out.Complete(), "exit code:", code)
	// Output:
	// epoch 1
	// epoch 2
	// complete: true exit code: 0
}

// A refusal is an *APIError: the HTTP status, the stable reason code and
// the field errors of the gateway's answer.
func ExampleAPIError() {
	ctx := context.Background()
	c, err := gpuplane.New(gatewayURL, gpuplane.WithToken(demoToken))
	if err != nil {
		log.Fatal(err)
	}
	_, err = c.Submit(ctx, "acme", contracts.JobRequest{
		ID:        "example-too-big",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 0, Model: "TPU-v5"}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(time.Second)},
	})
	var ae *gpuplane.APIError
	if errors.As(err, &ae) {
		fmt.Println(ae.StatusCode, ae.Reason, gpuplane.IsInvalid(err))
		for _, f := range ae.Fields {
			fmt.Println(f.Field, f.Reason)
		}
	}
	_, err = c.Job(ctx, "acme", "no-such-job")
	fmt.Println("not found:", gpuplane.IsNotFound(err), gpuplane.ReasonOf(err))
	_, err = c.Quotas(ctx) // every tenant's quotas: platform admins only
	fmt.Println("forbidden:", gpuplane.IsForbidden(err))
	// Output:
	// 400 invalid_request true
	// resources.gpu.count out_of_range
	// resources.gpu.model unknown_gpu_model
	// not found: true unknown_job
	// forbidden: true
}

// Iterate over every job of a tenant, page by page.
func ExampleClient_Jobs() {
	ctx := context.Background()
	c, err := gpuplane.New(gatewayURL, gpuplane.WithToken(adminToken))
	if err != nil {
		log.Fatal(err)
	}
	for _, id := range []string{"pages-1", "pages-2", "pages-3"} {
		_, err := c.Submit(ctx, "example-pages", contracts.JobRequest{ID: id,
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}},
			Run:       contracts.RunSpec{Duration: contracts.Duration(time.Second)}})
		if err != nil {
			log.Fatal(err)
		}
		// The list is the gateway's read model: wait for the job in it.
		if _, err := c.Wait(ctx, "example-pages", id); err != nil {
			log.Fatal(err)
		}
	}
	// Two jobs a page: newest first.
	for j, err := range c.Jobs(ctx, "example-pages", gpuplane.ListOptions{Limit: 2}) {
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(j.JobID, j.State)
	}
	// Output:
	// pages-3 succeeded
	// pages-2 succeeded
	// pages-1 succeeded
}

// The fleet, as a platform admin sees it.
func ExampleClient_Nodes() {
	ctx := context.Background()
	c, err := gpuplane.New(gatewayURL, gpuplane.WithToken(adminToken))
	if err != nil {
		log.Fatal(err)
	}
	nodes, err := c.Nodes(ctx, "l4")
	if err != nil {
		log.Fatal(err)
	}
	for _, n := range nodes.Nodes {
		fmt.Println(n.NodeID, n.Pool, len(n.GPUs), n.GPUs[0].Model)
	}
	// Output:
	// l4-01 l4 4 L4
	// l4-02 l4 4 L4
}

// Use the login gpuctl stored (gpuctl login), as gpuctl does: the token
// is read from the credentials file at each request.
func ExampleStoredLogin() {
	ctx := context.Background()
	// gpuctl's configuration directory: gpuplane.ConfigDir(os.Getenv)
	// (~/.config/gpuplane); a fresh one here, where gpuctl login would
	// have stored the demo user's token.
	dir, err := os.MkdirTemp("", "gpuctl-config-*")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := gpuplane.SaveCredential(dir, gatewayURL, gpuplane.Credential{Token: demoToken, Method: "token"}); err != nil {
		log.Fatal(err)
	}
	c, err := gpuplane.New(gatewayURL, gpuplane.WithTokenSource(gpuplane.StoredLogin(dir, gatewayURL)))
	if err != nil {
		log.Fatal(err)
	}
	who, err := c.WhoAmI(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(who.Subject, who.Bindings[0].Role, "of", who.Bindings[0].Tenant)
	// Output:
	// token:demo-acme member of acme
}
