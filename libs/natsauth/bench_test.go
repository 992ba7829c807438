package natsauth_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// BenchmarkPublishAuth is what authentication costs on the hot path: the
// JetStream publish rate of job requests to a file-backed JOBS stream from
// an open server (the baseline, as before issue 12), and from identities of
// growing permission lists on a server in operator mode, in the same run.
//
//	go test -run '^$' -bench PublishAuth -benchtime 20000x ./libs/natsauth/
func BenchmarkPublishAuth(b *testing.B) {
	payload := []byte(`{"id":"j","resources":{"gpu":{"count":1,"model":"any"}},"run":{"duration":"10s"}}`)
	cases := []struct {
		name string
		id   *contracts.Identity
	}{
		{"open-server", nil},
		{"operator", &contracts.Identity{Name: "operator", Role: contracts.BusOperator}},
		{"tenant", &contracts.Identity{Name: "tenant-acme", Role: contracts.BusTenant, Scope: "acme"}},
		{"gateway", &contracts.Identity{Name: "gateway", Role: contracts.BusGateway}},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			o := natsserver.Options{StoreDir: b.TempDir(), OnViolation: func(msg string) { b.Errorf("refused: %s", msg) }}
			var srv *natsserver.Server
			if tc.id == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				s, err := natsserver.Start(ctx, o) // no trust: open, as before authentication
				cancel()
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(s.Shutdown)
				srv = s
			} else {
				srv = natstest.StartWith(b, o)
			}
			var opts []nats.Option
			if tc.id != nil {
				co, err := natsauth.ClientOptions(natstest.Creds(b, srv, *tc.id))
				if err != nil {
					b.Fatal(err)
				}
				opts = co
				// The operator provisions the stream, as make run does.
				oco, err := natsauth.ClientOptions(natstest.Operator(b, srv))
				if err != nil {
					b.Fatal(err)
				}
				provision(b, srv.URL(), oco)
			} else {
				provision(b, srv.URL(), nil)
			}
			nc, err := nats.Connect(srv.URL(), opts...)
			if err != nil {
				b.Fatal(err)
			}
			defer nc.Close()
			js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
			if err != nil {
				b.Fatal(err)
			}
			subject := contracts.SubjectSubmit("acme")
			b.ResetTimer()
			start := time.Now()
			for i := range b.N {
				if _, err := js.PublishAsync(subject, payload, jetstream.WithMsgID(fmt.Sprintf("%s-%d", tc.name, i))); err != nil {
					b.Fatal(err)
				}
			}
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(time.Minute):
				b.Fatal("acks did not come")
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
		})
	}
}

func provision(b *testing.B, url string, opts []nats.Option) {
	b.Helper()
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, sc := range contracts.Streams(contracts.StreamOptions{}) {
		if sc.Name == contracts.StreamJobs {
			if _, err := js.CreateOrUpdateStream(ctx, sc); err != nil {
				b.Fatal(err)
			}
		}
	}
}
