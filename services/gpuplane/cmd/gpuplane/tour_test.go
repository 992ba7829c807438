package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/services/gpuctl"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

// envMain makes the test binary this program (main) instead of the tests:
// the tests start the real binary, flags, banner and signal handling
// included, without a go build of their own.
const envMain = "GPUPLANE_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	// A node agent's supervisor is a copy of this binary (main does the same).
	nodeagent.MaybeRunShim()
	switch {
	case filepath.Base(os.Args[0]) == "gpuctl":
		// The tour's commands call gpuctl: a link to this binary by that name.
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := gpuctl.Run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
		stop()
		os.Exit(code)
	case os.Getenv(envMain) != "":
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// readme is the repository's README.md.
func readme(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", "..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// platform is a gpuplane binary started by a test.
type platform struct {
	cmd     *exec.Cmd
	banner  []string // the lines it printed up to "Press Ctrl-C to stop."
	stdout  *bufio.Reader
	logFile string
	// exited receives Wait's error once the process ended and rest (what
	// it printed after the banner) was read to the end.
	exited chan error
	rest   []byte
}

// startPlatform runs this test binary as gpuplane with args, on free
// ports, and waits for its banner. Its logs go to a file named on failure.
func startPlatform(t *testing.T, env []string, args ...string) *platform {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p := &platform{logFile: filepath.Join(t.TempDir(), "gpuplane.log"), exited: make(chan error, 1)}
	logs, err := os.Create(p.logFile)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { logs.Close() })
	p.cmd = exec.Command(self, append([]string{"-nats-port", "-1", "-gateway-addr", "127.0.0.1:0",
		"-metrics-addr", "127.0.0.1:0"}, args...)...)
	p.cmd.Env = append(cleanEnv(), append(env, envMain+"=1", "GPUPLANE_LOG_LEVEL=warn")...)
	p.cmd.Stderr = logs
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p.stdout = bufio.NewReader(out)
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
		if t.Failed() {
			data, _ := os.ReadFile(p.logFile)
			t.Logf("gpuplane's log (last 4 KiB):\n%s", tail(string(data), 4096))
		}
	})
	lines := make(chan string)
	go func() {
		defer close(lines)
		for {
			line, err := p.stdout.ReadString('\n')
			if line != "" {
				lines <- strings.TrimRight(line, "\n")
			}
			if err != nil {
				return
			}
			if strings.HasPrefix(line, "Press Ctrl-C to stop.") {
				return
			}
		}
	}()
	// The banner comes once everything listens; a start that fails ends
	// the output instead. 120 s bounds a start under the race detector
	// on a busy 2-core machine (about 5 s when idle).
	timeout := time.After(120 * time.Second)
	for done := false; !done; {
		select {
		case line, ok := <-lines:
			if !ok {
				done = true
				break
			}
			p.banner = append(p.banner, line)
		case <-timeout:
			t.Fatalf("no banner within 120 s; printed so far: %q", p.banner)
		}
	}
	go func() {
		p.rest, _ = io.ReadAll(p.stdout) // before Wait, which closes the pipe
		p.exited <- p.cmd.Wait()
	}()
	if len(p.banner) == 0 || p.banner[len(p.banner)-1] != "Press Ctrl-C to stop." {
		err := <-p.exited
		t.Fatalf("gpuplane ended before its banner (%v); printed %q", err, p.banner)
	}
	return p
}

// stop sends sig and returns the exit code and what was printed after the
// banner.
func (p *platform) stop(t *testing.T, sig os.Signal) (int, string) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-p.exited:
		var exit *exec.ExitError
		switch {
		case err == nil:
			return 0, string(p.rest)
		case errors.As(err, &exit):
			return exit.ExitCode(), string(p.rest)
		default:
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("gpuplane did not stop within 60 s of the signal")
	}
	return -1, ""
}

// field is the first word after label in the banner ("NATS", "gateway").
func (p *platform) field(t *testing.T, label string) string {
	t.Helper()
	re := regexp.MustCompile(`^  ` + regexp.QuoteMeta(label) + `\s+(\S+)`)
	for _, l := range p.banner {
		if m := re.FindStringSubmatch(l); m != nil {
			return m[1]
		}
	}
	t.Fatalf("no %s line in the banner %q", label, p.banner)
	return ""
}

// line is the banner's line of label ("images").
func (p *platform) line(t *testing.T, label string) string {
	t.Helper()
	for _, l := range p.banner {
		if strings.HasPrefix(l, "  "+label+" ") {
			return l
		}
	}
	t.Fatalf("no %s line in the banner %q", label, p.banner)
	return ""
}

// cleanEnv is the environment without the GPUPLANE_ variables of whoever
// runs the tests, so the tour sees what a newcomer's shell has. A binary
// built with -race sleeps 1 s at exit by default (GORACE atexit_sleep_ms),
// which would add 40 s to the tour's 40 gpuctl commands.
func cleanEnv() []string {
	var env []string
	gorace := "atexit_sleep_ms=0"
	for _, kv := range os.Environ() {
		if v, ok := strings.CutPrefix(kv, "GORACE="); ok {
			gorace = v + " " + gorace
			continue
		}
		if !strings.HasPrefix(kv, "GPUPLANE_") && !strings.HasPrefix(kv, "TRACEPARENT=") &&
			!strings.HasPrefix(kv, "XDG_CONFIG_HOME=") {
			env = append(env, kv)
		}
	}
	return append(env, "GORACE="+gorace)
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// tourCommand is one command of the README's tour.
type tourCommand struct {
	line       int    // in README.md
	script     string // what bash runs
	exit       int    // the exit code its comment promises, 0 if none
	background bool   // it ends in "&"
	needsRunc  bool   // its comment says "(needs runc)": a container's step
	want       []string
}

var (
	exitNote      = regexp.MustCompile(`#.*\(exit (\d+)\)`)
	needsRuncNote = regexp.MustCompile(`#.*\(needs runc\)`)
)

// requireRuncEnv makes the tour's container steps run, or fail, where the
// banner says container runs cannot work here (.ci/run sets it as root).
const requireRuncEnv = "GPUPLANE_REQUIRE_RUNC"

// containersWork is what the banner says of container runs here.
const containersWork = "containers run with runc as root"

// tourCommands extracts the tour from the README: the ```sh blocks between
// the "tour:" comment and the "end of the tour" comment (the comment says
// how commands, their exit codes and their output are written).
func tourCommands(t *testing.T, doc string) []tourCommand {
	t.Helper()
	start := strings.Index(doc, "<!-- tour:")
	end := strings.Index(doc, "<!-- end of the tour -->")
	if start < 0 || end < start {
		t.Fatal(`README.md: no "<!-- tour:" ... "<!-- end of the tour -->" section`)
	}
	lineOf := func(off int) int { return strings.Count(doc[:off], "\n") + 1 }
	var cmds []tourCommand
	lines := strings.Split(doc[start:end], "\n")
	first := lineOf(start)
	// attach: comment lines of output follow the command just read (or
	// output lines of it), with nothing between.
	inBlock, attach := false, false
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		switch {
		case !inBlock && strings.TrimSpace(l) == "```sh":
			inBlock = true
			continue
		case inBlock && strings.TrimSpace(l) == "```":
			inBlock = false
			continue
		case !inBlock:
			continue
		}
		trimmed := strings.TrimSpace(l)
		if strings.HasPrefix(l, "#   ") && attach {
			cmds[len(cmds)-1].want = append(cmds[len(cmds)-1].want, strings.TrimSpace(strings.TrimPrefix(l, "#")))
			continue
		}
		if trimmed == "" || strings.HasPrefix(trimmed, "#") {
			attach = false
			continue
		}
		attach = true
		c := tourCommand{line: first + i}
		script := []string{l}
		// Continued lines and here-documents belong to the command.
		for strings.HasSuffix(script[len(script)-1], "\\") && i+1 < len(lines) {
			i++
			script = append(script, lines[i])
		}
		if m := regexp.MustCompile(`<<-?'?(\w+)'?`).FindStringSubmatch(l); m != nil {
			for i+1 < len(lines) {
				i++
				script = append(script, lines[i])
				if strings.TrimSpace(lines[i]) == m[1] {
					break
				}
			}
		}
		last := script[len(script)-1]
		if m := exitNote.FindStringSubmatch(last); m != nil {
			c.exit, _ = strconv.Atoi(m[1])
		}
		c.needsRunc = needsRuncNote.MatchString(last)
		code, _, _ := strings.Cut(last, " #")
		if strings.HasSuffix(strings.TrimSpace(code), "&") {
			c.background = true
			script[len(script)-1] = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(code), "&"))
		}
		c.script = strings.Join(script, "\n")
		cmds = append(cmds, c)
	}
	if len(cmds) == 0 {
		t.Fatal("README.md: the tour has no commands")
	}
	return cmds
}

// matches reports whether want, a line shown in the README with "..." for
// any text, is found in output from line from on, and the line after it.
// Runs of spaces count as one, so table columns may be wider or narrower.
func matches(want string, output []string, from int) (bool, int) {
	parts := strings.Split(squeeze(want), "...")
	for i := from; i < len(output); i++ {
		rest, ok := squeeze(output[i]), true
		for _, p := range parts {
			j := strings.Index(rest, strings.TrimSpace(p))
			if j < 0 {
				ok = false
				break
			}
			rest = rest[j+len(strings.TrimSpace(p)):]
		}
		if ok {
			return true, i + 1
		}
	}
	return false, from
}

func squeeze(s string) string { return strings.Join(strings.Fields(s), " ") }

// TestREADMETour runs the README's tour, command by command, as written,
// against the gpuplane binary (this test binary run as main) with the
// default fleet of `make run` on free ports and a fresh data directory:
// each command must exit as the README says and print the output lines
// the README shows. It also holds the README's quoted banner against the
// one printed, and checks that SIGINT stops everything with exit 0.
func TestREADMETour(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the tour takes about a minute")
	}
	doc := readme(t)
	cmds := tourCommands(t, doc)

	tmp := t.TempDir()
	dataDir, gpuctlDir, work, bin := filepath.Join(tmp, "data"), filepath.Join(tmp, "gpuctl"), filepath.Join(tmp, "work"), filepath.Join(tmp, "bin")
	for _, d := range []string{work, bin} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The tour runs in the repository's root (it names deploy/...); its
	// files (job.yaml) go to a scratch directory that links deploy/.
	if err := os.Symlink(self, filepath.Join(bin, "gpuctl")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(repoRoot(t), "deploy"), filepath.Join(work, "deploy")); err != nil {
		t.Fatal(err)
	}
	p := startPlatform(t, []string{"XDG_CONFIG_HOME=" + filepath.Join(tmp, "config")},
		"-data", dataDir, "-gpuctl-config", gpuctlDir)

	t.Run("banner", func(t *testing.T) {
		// The README quotes make run's banner with its default addresses;
		// this one has free ports and the test's directories.
		printed := strings.Join(p.banner, "\n")
		for from, to := range map[string]string{
			p.field(t, "NATS"): "nats://127.0.0.1:4222", p.field(t, "gateway"): "http://127.0.0.1:8080",
			p.field(t, "metrics"): "http://127.0.0.1:9400/metrics", dataDir: "/tmp/gpuplane-1234", gpuctlDir: "~/.config/gpuplane",
		} {
			printed = strings.ReplaceAll(printed, from, to)
		}
		quoted := readmeBanner(t, doc)
		got := strings.Split(strings.TrimSpace(printed), "\n")
		if len(got) != len(quoted) {
			t.Fatalf("README quotes %d banner lines, the binary prints %d:\n%s", len(quoted), len(got), printed)
		}
		for i, want := range quoted {
			if ok, _ := matches(want, got[i:i+1], 0); !ok {
				t.Errorf("banner line %d: README has\n  %q\nthe binary prints\n  %q", i+1, want, got[i])
			}
		}
	})

	env := append(cleanEnv(), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"), "GPUPLANE_CONFIG_DIR="+gpuctlDir)
	// The banner says whether container runs work here; where they do not,
	// the container steps are skipped, unless GPUPLANE_REQUIRE_RUNC=1.
	skipContainers := ""
	if images := p.line(t, "images"); !strings.Contains(images, containersWork) {
		if os.Getenv(requireRuncEnv) == "1" {
			t.Errorf("the banner says %q, and %s=1 requires the tour's container steps to run", images, requireRuncEnv)
		}
		skipContainers = images
	}
	var background []*exec.Cmd
	defer func() {
		for _, c := range background {
			_ = syscall.Kill(-c.Process.Pid, syscall.SIGKILL)
			_ = c.Wait()
		}
	}()
	for _, c := range cmds {
		if t.Failed() {
			break // later steps build on earlier ones
		}
		if c.needsRunc && skipContainers != "" {
			t.Logf("README.md:%d: skipped, container runs cannot work here (%s): %s", c.line, skipContainers, c.script)
			continue
		}
		var out bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		cmd := exec.CommandContext(ctx, "bash", "-c", c.script)
		cmd.Dir, cmd.Env, cmd.Stdout, cmd.Stderr = work, env, &out, &out
		// A command and what it starts (sleep in a wait loop) are one
		// process group, killed together at the bound.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
		if c.background {
			if err := cmd.Start(); err != nil {
				t.Fatalf("README.md:%d: %v", c.line, err)
			}
			background = append(background, cmd)
			cancel()
			continue
		}
		began := time.Now()
		err := cmd.Run()
		t.Logf("README.md:%d (%.1f s): %s", c.line, time.Since(began).Seconds(), c.script)
		timedOut := ctx.Err() != nil
		cancel()
		code := 0
		var exit *exec.ExitError
		switch {
		case errors.As(err, &exit):
			code = exit.ExitCode()
		case err != nil:
			t.Fatalf("README.md:%d: %s: %v", c.line, c.script, err)
		}
		if timedOut {
			t.Errorf("README.md:%d: %s: still running after 90 s; output:\n%s", c.line, c.script, out.String())
			continue
		}
		if code != c.exit {
			t.Errorf("README.md:%d: %s: exit %d, the README says %d; output:\n%s", c.line, c.script, code, c.exit, out.String())
			continue
		}
		lines, from := strings.Split(out.String(), "\n"), 0
		for _, w := range c.want {
			var ok bool
			if ok, from = matches(w, lines, from); !ok {
				t.Errorf("README.md:%d: %s: the README shows %q (in this order), not in its output:\n%s", c.line, c.script, w, out.String())
				break
			}
		}
	}

	code, rest := p.stop(t, os.Interrupt)
	if code != 0 {
		t.Errorf("gpuplane exited %d after SIGINT, want 0; it printed %q", code, rest)
	}
	if want := "gpuplane stopped: runs stopped, services drained, NATS shut down; its data is kept in " + dataDir; !strings.Contains(rest, want) {
		t.Errorf("after SIGINT gpuplane printed %q, want %q", rest, want)
	}
}

// readmeBanner is the fenced block after "`make run` prints where
// everything is:".
func readmeBanner(t *testing.T, doc string) []string {
	t.Helper()
	_, after, ok := strings.Cut(doc, "`make run` prints where everything is:")
	if !ok {
		t.Fatal("README.md: no \"`make run` prints where everything is:\"")
	}
	_, block, ok := strings.Cut(after, "```\n")
	block, _, ok2 := strings.Cut(block, "```")
	if !ok || !ok2 {
		t.Fatal("README.md: no fenced banner after \"`make run` prints where everything is:\"")
	}
	return strings.Split(strings.TrimSpace(block), "\n")
}

// TestSignalStopsCleanly: the banner comes once the fleet is registered;
// SIGTERM (systemd, kill) ends the binary as Ctrl-C does, exit 0 after a
// clean shutdown, and a temporary data directory is removed.
func TestSignalStopsCleanly(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts the whole platform")
	}
	tmp := t.TempDir()
	fleetFile := filepath.Join(tmp, "fleet.yaml")
	if err := os.WriteFile(fleetFile, []byte("machineTypes:\n  l4x1: {gpuModel: L4, gpuCount: 1}\npools:\n  - {name: static, machineType: l4x1, count: 1}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	p := startPlatform(t, []string{"XDG_CONFIG_HOME=" + filepath.Join(tmp, "config"), "TMPDIR=" + tmp},
		"-fleet", fleetFile, "-autoscale", "", "-gpuctl-config", filepath.Join(tmp, "gpuctl"))
	re := regexp.MustCompile(`\(data in (\S+)\)`)
	var dataDir string
	for _, l := range p.banner {
		if m := re.FindStringSubmatch(l); m != nil {
			dataDir = m[1]
		}
	}
	if !strings.HasPrefix(dataDir, tmp) {
		t.Fatalf("data directory %q, want a temporary one under %s", dataDir, tmp)
	}
	// The banner waits for the fleet: its machine is registered already.
	var out, errOut bytes.Buffer
	env := map[string]string{"GPUPLANE_CONFIG_DIR": filepath.Join(tmp, "gpuctl")}
	if code := gpuctl.Run(context.Background(), []string{"nodes"}, &out, &errOut, func(k string) string { return env[k] }); code != gpuctl.ExitOK ||
		!regexp.MustCompile(`(?m)^static-01 .* registered `).MatchString(out.String()) {
		t.Errorf("gpuctl nodes right after the banner: exit %d, %s%s; want static-01 registered", code, out.String(), errOut.String())
	}
	code, rest := p.stop(t, syscall.SIGTERM)
	if code != 0 {
		t.Errorf("exit %d after SIGTERM, want 0; printed %q", code, rest)
	}
	if !strings.Contains(rest, "its temporary data directory is removed") {
		t.Errorf("after SIGTERM: %q", rest)
	}
	if _, err := os.Stat(dataDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("temporary data directory %s: %v, want it removed", dataDir, err)
	}
}

// TestTourConvention holds the README's convention as TestREADMETour
// reads it: commands (continued lines and here-documents included), their
// "(exit N)", a trailing "&", and the output lines right under them.
func TestTourConvention(t *testing.T) {
	doc := "intro\n```sh\nnot-in-the-tour\n```\n<!-- tour: how -->\n```sh\n" +
		"# a comment\n" +
		"gpuctl submit --id a   # submit\n" +
		"#   job a submitted (tenant ..., JOBS #...)\n" +
		"#   second line\n" +
		"\n" +
		"#   not output: a blank line came between\n" +
		"gpuctl watch a &       # in the background\n" +
		"gpuctl submit --gpus 0 \\\n  --id bad   # fails (exit 1)\n" +
		"#   out_of_range\n" +
		"gpuctl logs c   # (needs runc)\n" +
		"cat > f <<'YAML'\nid: x\n#   inside\nYAML\n" +
		"```\ntext\n<!-- end of the tour -->\n```sh\nafter\n```\n"
	got := tourCommands(t, doc)
	want := []tourCommand{
		{line: 8, script: "gpuctl submit --id a   # submit", want: []string{"job a submitted (tenant ..., JOBS #...)", "second line"}},
		{line: 13, script: "gpuctl watch a", background: true},
		{line: 14, script: "gpuctl submit --gpus 0 \\\n  --id bad   # fails (exit 1)", exit: 1, want: []string{"out_of_range"}},
		{line: 17, script: "gpuctl logs c   # (needs runc)", needsRunc: true},
		{line: 18, script: "cat > f <<'YAML'\nid: x\n#   inside\nYAML"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d commands %+v, want %d", len(got), got, len(want))
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.line != w.line || g.script != w.script || g.exit != w.exit || g.background != w.background || g.needsRunc != w.needsRunc ||
			strings.Join(g.want, "|") != strings.Join(w.want, "|") {
			t.Errorf("command %d: got %+v, want %+v", i, g, w)
		}
	}
}

func TestTourOutputMatches(t *testing.T) {
	out := []string{"17:44:06.717 queued attempt=1", "17:44:06.722 scheduled attempt=1 node=h100-03   gpus=0",
		"GPU  UUID  HEALTH", "0    GPU-15  UNHEALTHY"}
	for _, tc := range []struct {
		want string
		from int
		ok   bool
		next int
	}{
		{"... queued attempt=1", 0, true, 1},
		{"... scheduled attempt=1 node=h100-03 gpus=0", 0, true, 2},
		{"... scheduled attempt=1 node=h100-... gpus=0", 0, true, 2},
		{"... scheduled attempt=1 node=h100-01 gpus=0", 0, false, 0},
		{"... queued attempt=1", 1, false, 1}, // in order: not before from
		{"0 ... GPU-15 ... UNHEALTHY", 0, true, 4},
		{"UNHEALTHY ... GPU-15", 0, false, 0}, // fragments in order
	} {
		ok, next := matches(tc.want, out, tc.from)
		if ok != tc.ok || next != tc.next {
			t.Errorf("matches(%q, from %d) = %v, %d; want %v, %d", tc.want, tc.from, ok, next, tc.ok, tc.next)
		}
	}
}

// TestBannerImagesLine: the banner's images line says whether container
// runs work here, and the README's quoted line matches it either way, so
// the tour's banner check holds on a machine without runc too.
func TestBannerImagesLine(t *testing.T) {
	var quoted string
	for _, l := range readmeBanner(t, readme(t)) {
		if strings.HasPrefix(l, "  images ") {
			quoted = l
		}
	}
	if quoted == "" {
		t.Fatal("README.md: the quoted banner has no images line")
	}
	for _, tc := range []struct {
		ep    gpuplane.Endpoints
		works bool
	}{
		{gpuplane.Endpoints{Images: []string{gpuplane.BusyboxRef}}, true},
		{gpuplane.Endpoints{Images: []string{gpuplane.BusyboxRef}, ImagesNote: "container runs fail with runtime_unavailable: no runc (Debian: apt-get install runc)"}, false},
		{gpuplane.Endpoints{Images: []string{gpuplane.BusyboxRef}, ImagesNote: "container runs fail: runc needs root"}, false},
	} {
		var line string
		for _, l := range strings.Split(banner(tc.ep, ""), "\n") {
			if strings.HasPrefix(l, "  images ") {
				line = l
			}
		}
		if ok, _ := matches(quoted, []string{line}, 0); !ok {
			t.Errorf("README's %q does not match the banner's %q", quoted, line)
		}
		if got := strings.Contains(line, containersWork); got != tc.works {
			t.Errorf("banner line %q: says containers work = %v, want %v", line, got, tc.works)
		}
		if !tc.works && !strings.Contains(line, tc.ep.ImagesNote) {
			t.Errorf("banner line %q does not say why: %q", line, tc.ep.ImagesNote)
		}
	}
}
