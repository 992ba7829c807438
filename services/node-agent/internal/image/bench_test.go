package image_test

import (
	"context"
	"testing"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
)

// BenchmarkPullUnpack: a pull of the busybox test image (4 gzip layers,
// 1 MB compressed, 2 MB unpacked) from a registry on 127.0.0.1 into an
// empty cache.
func BenchmarkPullUnpack(b *testing.B) {
	reg := startRegistry(b)
	ref := reg.push(b, "team/busybox:1", busyboxImageAs(b, "one", "gzip"), image.Auth{})
	var img image.Image
	for b.Loop() {
		b.StopTimer()
		c := newCache(b, image.Config{})
		b.StartTimer()
		var release func()
		var err error
		img, release, err = c.Acquire(context.Background(), ref, image.Auth{}, nil)
		if err != nil {
			b.Fatal(err)
		}
		release()
	}
	if img.Size == 0 {
		b.Fatal("nothing unpacked")
	}
	b.ReportMetric(float64(img.Size)/(1<<20), "MiB-unpacked/op")
}

// BenchmarkCacheHit: an Acquire of a cached image, by digest (no network)
// and by tag (one HEAD to the registry on 127.0.0.1).
func BenchmarkCacheHit(b *testing.B) {
	reg := startRegistry(b)
	byDigest := reg.push(b, "team/busybox:1", busyboxImage(b, "one"), image.Auth{})
	for name, ref := range map[string]string{"digest": byDigest, "tag": reg.host + "/team/busybox:1"} {
		b.Run(name, func(b *testing.B) {
			c := newCache(b, image.Config{})
			first, release := acquire(b, c, ref, image.Auth{})
			release()
			reg.reset()
			for b.Loop() {
				img, release, err := c.Acquire(context.Background(), ref, image.Auth{}, nil)
				if err != nil || img.RootFS != first.RootFS {
					b.Fatalf("acquire: %s, %v", img.RootFS, err)
				}
				release()
			}
			if n := reg.count("GET blob"); n != 0 {
				b.Fatalf("%d blob downloads on cache hits", n)
			}
		})
	}
}
