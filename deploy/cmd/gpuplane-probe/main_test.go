package main

import (
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// TestBusProbe: ready while the server answers, not once it is gone.
func TestBusProbe(t *testing.T) {
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("server not ready")
	}
	url := s.ClientURL()
	if err := busProbe([]string{"-nats", url, "-creds", "", "-nats-ca", ""}); err != nil {
		t.Fatalf("server up: %v", err)
	}
	s.Shutdown()
	s.WaitForShutdown()
	if err := busProbe([]string{"-nats", url, "-creds", "", "-nats-ca", "", "-timeout", "500ms"}); err == nil {
		t.Fatal("server down, probe passed")
	}
}

// TestRunningProbe: a running process passes, a stopped one (SIGSTOP)
// fails, and passes again once continued.
func TestRunningProbe(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Skipf("no sleep: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	pid := strconv.Itoa(cmd.Process.Pid)
	if err := runningProbe([]string{"-pid", pid}); err != nil {
		t.Fatalf("running process: %v", err)
	}
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// The kernel marks the process stopped asynchronously: wait (bounded)
	// for the probe to see it.
	deadline := time.Now().Add(10 * time.Second)
	for runningProbe([]string{"-pid", pid}) == nil {
		if time.Now().After(deadline) {
			t.Fatal("a stopped process passed the probe for 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(10 * time.Second)
	for runningProbe([]string{"-pid", pid}) != nil {
		if time.Now().After(deadline) {
			t.Fatal("a continued process failed the probe for 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := runningProbe([]string{"-pid", strconv.Itoa(1 << 30)}); err == nil {
		t.Fatal("a process that does not exist passed")
	}
}

// TestProcState reads the state after a command name holding spaces and
// parentheses.
func TestProcState(t *testing.T) {
	for stat, want := range map[string]byte{
		"1 (scheduler) S 0 1 1":  'S',
		"7 (a) b) (c) T 1 7 7":   'T',
		"9 (node agent) Z 1 9 9": 'Z',
	} {
		got, err := procState(stat)
		if err != nil || got != want {
			t.Errorf("%q: %c, %v; want %c", stat, got, err, want)
		}
	}
	if _, err := procState("garbage"); err == nil {
		t.Error("garbage parsed")
	}
}
