package nvmlgpu

import (
	"errors"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

func TestOpenErrors(t *testing.T) {
	tests := []struct {
		name  string
		setup func(m *fakeMachine)
		is    error    // the error wraps this, when set
		say   []string // and says these
	}{
		{"no driver library", func(m *fakeMachine) {
			m.InitFunc = func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }
		}, ErrLibraryNotFound, []string{"libnvidia-ml.so.1 not found", "is the NVIDIA driver installed", "use backend sim"}},
		{"kernel module not loaded", func(m *fakeMachine) {
			m.InitFunc = func() nvml.Return { return nvml.ERROR_DRIVER_NOT_LOADED }
		}, nvml.ERROR_DRIVER_NOT_LOADED, []string{"kernel module is not loaded"}},
		{"no permission", func(m *fakeMachine) {
			m.InitFunc = func() nvml.Return { return nvml.ERROR_NO_PERMISSION }
		}, nvml.ERROR_NO_PERMISSION, []string{"nvml backend: nvml.Init: "}},
		{"no GPU", func(m *fakeMachine) {
			m.DeviceGetCountFunc = func() (int, nvml.Return) { return 0, nvml.SUCCESS }
		}, nil, []string{"sees no usable GPU"}},
		{"every GPU lost", func(m *fakeMachine) {
			m.DeviceGetHandleByIndexFunc = func(int) (nvml.Device, nvml.Return) { return nil, nvml.ERROR_GPU_IS_LOST }
		}, nil, []string{"sees no usable GPU (8 listed)"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newFakeMachine(t)
			tc.setup(m)
			_, err := Open(Config{Lib: m})
			if err == nil {
				t.Fatal("Open succeeded")
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("error %v does not wrap %v", err, tc.is)
			}
			for _, s := range tc.say {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not say %q", err, s)
				}
			}
			// Init succeeded in the last two: Open must undo it.
			if inits, shutdowns := len(m.InitCalls()), len(m.ShutdownCalls()); tc.is == nil && shutdowns != inits {
				t.Errorf("%d Init, %d Shutdown; want them paired", inits, shutdowns)
			}
		})
	}
}

// TestOpenWithoutTheLibrary loads the real library loader with a path
// that exists nowhere: what a machine without the NVIDIA driver sees.
func TestOpenWithoutTheLibrary(t *testing.T) {
	_, err := Open(Config{Lib: nvml.New(nvml.WithLibraryPath("/nonexistent/libnvidia-ml.so.1"))})
	if !errors.Is(err, ErrLibraryNotFound) {
		t.Fatalf("Open: %v; want ErrLibraryNotFound", err)
	}
	want := "nvml backend: NVIDIA driver library libnvidia-ml.so.1 not found " +
		"(is the NVIDIA driver installed and this a GPU machine? use backend sim otherwise)"
	if !strings.HasPrefix(err.Error(), want) {
		t.Errorf("error %q\nwant it to start %q", err, want)
	}
}

// TestOpenThisMachine opens the driver of the machine the test runs on:
// without a GPU (CI, a laptop) it must fail with the clear error; with
// one it must find the GPUs.
func TestOpenThisMachine(t *testing.T) {
	b, err := Open(Config{NodeID: "this"})
	if err != nil {
		if !errors.Is(err, ErrLibraryNotFound) {
			t.Fatalf("Open: %v; want ErrLibraryNotFound on a machine without the driver", err)
		}
		t.Logf("no NVIDIA driver here: %v", err)
		return
	}
	defer b.Close()
	if len(b.gpus) == 0 {
		t.Fatal("Open succeeded with no GPU")
	}
	t.Logf("NVIDIA driver here: %d GPUs", len(b.gpus))
}
