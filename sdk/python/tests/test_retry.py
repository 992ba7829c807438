"""Retries, backoff and TLS against a stub HTTP server that answers from a
script: what a real gateway does only under faults (a 503, a dropped
connection, a 429 with Retry-After)."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import unittest
from typing import Any, Optional

import gpuplane

ACCEPTED = {"tenant": "acme", "jobId": "x", "stream": "JOBS", "sequence": 7, "duplicate": False}


def api_error(reason: str, message: str, fields: Optional[list[dict[str, str]]] = None) -> dict[str, Any]:
    body: dict[str, Any] = {"reason": reason, "message": message}
    if fields:
        body["fields"] = fields
    return {"error": body}


class Stub:
    """Answers each request with the next step of script: (status, JSON
    body, headers), or "drop" to close the connection without an answer.
    The last step repeats. It records (method, path, headers, body)."""

    def __init__(self, script: list[Any], tls: Optional[tuple[str, str]] = None) -> None:
        self.script = script
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                stub.requests.append((self.command, self.path, dict(self.headers), body))
                step = stub.script[min(len(stub.requests), len(stub.script)) - 1]
                if step == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, doc, headers = step
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RetryTest(unittest.TestCase):
    def client(self, stub: Stub, **kw: Any) -> tuple[gpuplane.Client, list[float]]:
        c = gpuplane.Client(stub.url, token="t0k", tenant="acme", env={}, **kw)
        slept: list[float] = []
        c.sleep = slept.append  # record the backoff instead of waiting it
        return c, slept

    def stub(self, script: list[Any], **kw: Any) -> Stub:
        s = Stub(script, **kw)
        self.addCleanup(s.close)
        return s

    def test_submit_retried_after_5xx_and_a_dropped_connection(self) -> None:
        s = self.stub([(503, api_error("unavailable", "catching up"), {}), "drop", (202, ACCEPTED, {})])
        c, slept = self.client(s)
        sub = c.submit(gpus=1, model="L4", command=["true"])
        self.assertEqual(sub.response.sequence, 7)
        self.assertEqual(len(s.requests), 3)
        bodies = [json.loads(r[3]) for r in s.requests]
        # One job: the ID the client made is in every try.
        self.assertEqual(len({b["id"] for b in bodies}), 1, bodies)
        self.assertTrue(bodies[0]["id"])
        self.assertEqual([r[2].get("Authorization") for r in s.requests], ["Bearer t0k"] * 3)
        # Exponential backoff with jitter: half to all of 0.1 s, then 0.2 s.
        self.assertEqual(len(slept), 2)
        self.assertTrue(0.05 <= slept[0] <= 0.1 and 0.1 <= slept[1] <= 0.2, slept)

    def test_backoff_grows_and_is_capped(self) -> None:
        s = self.stub([(502, {}, {})])
        c, slept = self.client(s, retries=6, backoff=1.0, max_backoff=4.0)
        c.random = lambda: 1.0  # the top of each jitter range
        with self.assertRaises(gpuplane.ServerError) as cm:
            c.get("j")
        self.assertEqual(cm.exception.status, 502)
        self.assertEqual(cm.exception.reason, "http_502")  # not the gateway's body
        self.assertEqual(slept, [1.0, 2.0, 4.0, 4.0, 4.0, 4.0])
        self.assertEqual(len(s.requests), 7)

    def test_retry_after_is_honoured(self) -> None:
        s = self.stub([(429, api_error("rate_limited", "slow down"), {"Retry-After": "3"}), (200, {"status": "ok"}, {})])
        c, slept = self.client(s)
        self.assertEqual(c.health(), {"status": "ok"})
        self.assertEqual(len(slept), 1)
        self.assertGreaterEqual(slept[0], 3.0)

    def test_retries_run_out(self) -> None:
        s = self.stub([(503, api_error("unavailable", "the read model is still catching up"), {})])
        c, slept = self.client(s, retries=2)
        with self.assertRaises(gpuplane.UnavailableError) as cm:
            c.cancel("j1")
        self.assertEqual((cm.exception.status, cm.exception.reason), (503, "unavailable"))
        self.assertIsInstance(cm.exception, gpuplane.ServerError)
        self.assertEqual(len(s.requests), 3)
        self.assertEqual(s.requests[0][:2], ("DELETE", "/v1/tenants/acme/jobs/j1"))

    def test_client_errors_are_not_retried(self) -> None:
        fields = [{"field": "resources.gpu.count", "reason": "out_of_range", "message": "gpu count is 0"}]
        s = self.stub([(400, api_error("invalid_request", "invalid job request", fields), {})])
        c, slept = self.client(s)
        with self.assertRaises(gpuplane.InvalidRequestError) as cm:
            c.submit(id="j", gpus=0)
        self.assertEqual(cm.exception.fields, [gpuplane.FieldError(field="resources.gpu.count",
                                                                   reason="out_of_range", message="gpu count is 0")])
        self.assertEqual((len(s.requests), slept), (1, []))

    def test_submit_takes_a_request_or_its_arguments(self) -> None:
        s = self.stub([(202, ACCEPTED, {})])
        c, _ = self.client(s)
        req = gpuplane.JobRequest(resources=gpuplane.Resources(gpu=gpuplane.GPURequest(count=1)),
                                  run=gpuplane.RunSpec(duration="1s"))
        with self.assertRaises(TypeError):
            c.submit(req, gpus=2)
        self.assertEqual(s.requests, [])
        c.submit(req)
        # The ID the client made is on the request, and is what was sent.
        self.assertRegex(req.id, r"^[0-9A-HJKMNP-TV-Z]{26}$")
        self.assertEqual(json.loads(s.requests[0][3])["id"], req.id)
        # The keyword arguments make the same document.
        c.submit(id="c1", gpus=2, model="H100-80GB", image="nvcr.io/nvidia/pytorch:24.01-py3", args=["python", "t.py"],
                 env={"A": "1"}, priority="high")
        self.assertEqual(json.loads(s.requests[1][3]), {
            "id": "c1", "priority": "high", "resources": {"gpu": {"count": 2, "model": "H100-80GB"}},
            "run": {"image": "nvcr.io/nvidia/pytorch:24.01-py3", "args": ["python", "t.py"], "env": {"A": "1"}}})

    def test_connection_refused(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # Nothing listens on port now.
        c = gpuplane.Client(f"http://127.0.0.1:{port}", token="t", env={}, retries=3)
        slept: list[float] = []
        c.sleep = slept.append
        with self.assertRaises(gpuplane.TransportError):
            c.usage()
        self.assertEqual(len(slept), 3)

    def test_submission_waits_for_the_job_to_appear(self) -> None:
        # Right after a submit the gateway does not know the job yet.
        unknown: tuple[int, dict[str, Any], dict[str, str]] = (404, api_error("unknown_job", "tenant acme has no job x"), {})
        s = self.stub([(202, ACCEPTED, {}), unknown, unknown, (200, {"status": "ok"}, {})])
        c, slept = self.client(s)
        sub = c.submit(id="x", duration="1s")
        # Only the 404s are waited out, not any other answer.
        job = {"tenant": "acme", "jobId": "x", "state": "queued", "attempt": 1, "createdAt": "2026-01-01T00:00:00Z",
               "updatedAt": "2026-01-01T00:00:00Z", "lastSeq": 1}
        s.script[3] = (200, job, {})
        self.assertEqual(sub.get().state, "queued")
        self.assertEqual(len(slept), 2)
        # A job the gateway knew once and does not know now is an error.
        s.script.append(unknown)
        with self.assertRaises(gpuplane.NotFoundError):
            sub.get()


class TLSTest(unittest.TestCase):
    def setUp(self) -> None:
        if shutil.which("openssl") is None:
            self.skipTest("openssl is not installed (apt-get install openssl)")
        self.dir = tempfile.mkdtemp(prefix="gpuplane-pysdk-tls-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.cert, self.key = os.path.join(self.dir, "cert.pem"), os.path.join(self.dir, "key.pem")
        # A self-signed certificate for 127.0.0.1: its own CA.
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", self.key,
                        "-out", self.cert], check=True, capture_output=True, timeout=60)

    def test_ca_file(self) -> None:
        s = Stub([(200, {"status": "ok"}, {})], tls=(self.cert, self.key))
        self.addCleanup(s.close)
        trusted = gpuplane.Client(s.url, token="t", env={}, ca_file=self.cert)
        self.assertEqual(trusted.health(), {"status": "ok"})
        # From the environment, as gpuctl reads it.
        from_env = gpuplane.Client(s.url, token="t", env={"GPUPLANE_CA_CERT": self.cert})
        self.assertEqual(from_env.health(), {"status": "ok"})
        # Without the CA the certificate is refused, and not retried.
        untrusted = gpuplane.Client(s.url, token="t", env={})
        slept: list[float] = []
        untrusted.sleep = slept.append
        with self.assertRaises(gpuplane.TransportError) as cm:
            untrusted.health()
        self.assertIsInstance(cm.exception.__cause__, ssl.SSLCertVerificationError)
        self.assertEqual(slept, [])

    def test_missing_ca_file(self) -> None:
        with self.assertRaises(gpuplane.ConfigurationError):
            gpuplane.Client("https://127.0.0.1:1", env={}, ca_file=os.path.join(self.dir, "nope.pem"))


if __name__ == "__main__":
    unittest.main()
