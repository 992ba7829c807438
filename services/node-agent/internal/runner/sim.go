package runner

import (
	"fmt"
	"os"
	"sync"
	"time"
)

// sigtermExit is the exit code of a process ended by SIGTERM; a stopped
// simulated run reports it too.
const sigtermExit = 128 + 15

// simProc is a simulated run: it waits for its duration and exits with the
// spec's exit code, or ends at once when stopped.
type simProc struct {
	done  chan struct{}
	stop  chan struct{}
	once  sync.Once
	mu    sync.Mutex
	exit  Exit
	timer *time.Timer
}

func startSim(l Launch, logFile *os.File) *simProc {
	fmt.Fprintf(logFile, "simulated run of %s on %v, exit code %d\n", l.Spec.Duration.D(), l.DeviceUUIDs, l.Spec.ExitCode)
	_ = logFile.Close()
	p := &simProc{done: make(chan struct{}), stop: make(chan struct{}), timer: time.NewTimer(max(l.Spec.Duration.D(), 0))}
	go func() {
		defer close(p.done)
		select {
		case <-p.timer.C:
			p.exit = Exit{Code: l.Spec.ExitCode}
		case <-p.stop:
			p.timer.Stop()
			p.exit = Exit{Code: sigtermExit, Stopped: true}
		}
	}()
	return p
}

func (p *simProc) Wait() Exit {
	<-p.done
	return p.exit
}

func (p *simProc) Done() <-chan struct{} { return p.done }

func (p *simProc) Stop(time.Duration) { p.once.Do(func() { close(p.stop) }) }
