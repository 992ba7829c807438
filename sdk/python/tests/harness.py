"""What the tests start: the all-in-one gpuplane binary on free ports with a
fresh data directory, and a TCP proxy that breaks connections on purpose.

The binary is $GPUPLANE_BIN when set (the Makefile builds it once), else it
is built here with ``go build`` into a temporary directory.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Callable, Optional

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

# Two machines of two L4s each: enough for the tests' jobs side by side.
FLEET = """
machineTypes:
  l4x2: {gpuModel: L4, gpuCount: 2}
pools:
  - {name: static, machineType: l4x2, count: 2}
"""

_built: Optional[str] = None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, so a
    test run killed from outside (a timeout) leaves no platform behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def gpuplane_binary() -> str:
    """$GPUPLANE_BIN, or the binary built once for this test run."""
    global _built
    if os.environ.get("GPUPLANE_BIN"):
        return os.environ["GPUPLANE_BIN"]
    if _built is None:
        out = os.path.join(tempfile.mkdtemp(prefix="gpuplane-pysdk-bin-"), "gpuplane")
        subprocess.run(["go", "build", "-o", out, "./services/gpuplane/cmd/gpuplane"], cwd=REPO, check=True,
                       timeout=900)
        _built = out
    return _built


def eventually(what: str, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Waits, bounded, for cond to hold; fails naming what it waited for."""
    deadline = time.monotonic() + timeout
    pause = 0.02
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"gave up after {timeout}s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.25)


class Platform:
    """The all-in-one binary: embedded NATS, every service, a simulated
    fleet, the gateway with authentication on."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="gpuplane-pysdk-")
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.gateway = ""
        self.gpuctl_dir = os.path.join(self.dir, "gpuctl")
        self.tokens_dir = os.path.join(self.dir, "data", "tokens")

    def start(self, timeout: float = 60.0) -> None:
        fleet = os.path.join(self.dir, "fleet.yaml")
        with open(fleet, "w", encoding="utf-8") as f:
            f.write(FLEET)
        # Only what the flags say: no GPUPLANE_* setting of the caller's,
        # and the nats CLI contexts it writes land in the temporary
        # directory, not in the user's configuration.
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPLANE_")}
        env["XDG_CONFIG_HOME"] = os.path.join(self.dir, "xdg")
        args = [gpuplane_binary(), "-data", os.path.join(self.dir, "data"), "-nats-port", "-1",
                "-gateway-addr", "127.0.0.1:0", "-metrics-addr", "127.0.0.1:0", "-fleet", fleet,
                "-autoscale", "", "-gpuctl-config", self.gpuctl_dir, "-run-logs", os.path.join(self.dir, "runs")]
        self.stdout_path = os.path.join(self.dir, "stdout.txt")
        self.stderr_path = os.path.join(self.dir, "stderr.txt")
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while not self.gateway:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpuplane exited with {self.proc.returncode} before it was up:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"gpuplane not up after {timeout}s:\n{self.log_tail()}")
            with open(self.stdout_path, encoding="utf-8", errors="replace") as f:
                m = re.search(r"^\s*gateway\s+(https?://\S+)", f.read(), re.MULTILINE)
            if m:
                self.gateway = m.group(1)
            else:
                time.sleep(0.05)

    def token(self, name: str) -> str:
        """A token make run writes: admin (platform admin) or demo-acme
        (member of acme)."""
        with open(os.path.join(self.tokens_dir, name + ".token"), encoding="utf-8") as f:
            return f.read().strip()

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.stderr_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Stops the binary (SIGTERM: it stops its runs and drains; SIGKILL
        to its process group after 20 s) and removes its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Proxy:
    """A TCP proxy in front of a server that can break connections: cut
    (called with the connection's number, counted from 0, and the bytes the
    server has sent on it so far) returns how many of them to pass on
    before closing both sides, or None to pass everything. It records the
    requests' bytes per connection."""

    def __init__(self, upstream: str, cut: Callable[[int, bytes], Optional[int]]) -> None:
        host, _, port = upstream.rpartition("//")[2].partition(":")
        self.upstream = (host, int(port))
        self.cut = cut
        self.requests: list[bytes] = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.closed = False
        self.threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)

    def connections(self) -> int:
        with self.lock:
            return len(self.requests)

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                n = len(self.requests)
                self.requests.append(b"")
            t = threading.Thread(target=self._pump, args=(n, client), daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, n: int, client: socket.socket) -> None:
        up = socket.create_connection(self.upstream)
        sent = b""  # what the server sent on this connection
        try:
            while True:
                r, _, _ = select.select([client, up], [], [], 30)
                if not r:
                    return
                if client in r:
                    data = client.recv(65536)
                    if not data:
                        return
                    with self.lock:
                        self.requests[n] += data
                    up.sendall(data)
                if up in r:
                    data = up.recv(65536)
                    if not data:
                        return
                    sent += data
                    keep = self.cut(n, sent)
                    if keep is not None:
                        # Pass on what is left of the first keep bytes,
                        # then break the connection.
                        already = len(sent) - len(data)
                        if keep > already:
                            client.sendall(sent[already:keep])
                        return
                    client.sendall(data)
        except OSError:
            return
        finally:
            for s in (client, up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()
