"""The gateway's REST API as a Python client.

Every call is safe to repeat and is retried, with exponential backoff and
jitter, after a connection error or a 429, 500, 502, 503 or 504 answer:
reads are, a cancel is (the gateway de-duplicates it per job), and so is a
submit, because the job ID makes it idempotent (the gateway publishes it
with a message ID per tenant and job, and a repeat comes back as
``duplicate``); the client generates the ID when the caller gives none, so
that a retried submit is the same job and never a second one.
"""

from __future__ import annotations

import codecs
import http.client
import json
import os
import random
import secrets
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Mapping, Optional, TypeVar, Union

from . import auth
from .errors import APIError, ConfigurationError, TransportError, WaitTimeout, api_error
from .models import (GPURequest, JobDescription, JobEvent, JobList, JobRequest, JobStatus, Resources, RunSpec,
                     SubmitResponse, UsageSummary, from_dict, to_dict)

__all__ = ["Client", "Submission", "new_job_id"]

T = TypeVar("T")

# Statuses a retry can cure: the request was not carried out, or carrying
# it out again is harmless (every call of this client is idempotent).
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_job_id() -> str:
    """A ULID (48-bit millisecond time, 80 random bits, Crockford base32),
    the shape of the IDs the gateway and gpuctl generate
    (contracts.NewJobID): time-ordered and always a valid job ID."""
    n = (int(time.time() * 1000) & ((1 << 48) - 1)) << 80 | secrets.randbits(80)
    return "".join(_CROCKFORD[(n >> (5 * i)) & 31] for i in reversed(range(26)))


@dataclass
class _Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


@dataclass
class _Stream:
    """An open answer: its connection (to close) and socket."""

    conn: http.client.HTTPConnection
    resp: http.client.HTTPResponse
    sock: Optional[socket.socket]


def _q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


class Client:
    """A client of one gateway.

    Settings not given are read as gpuctl reads them (see gpuplane.auth):
    $GPUPLANE_GATEWAY, $GPUPLANE_TOKEN, $GPUPLANE_TENANT, $GPUPLANE_CA_CERT
    and the credentials file ``gpuctl login`` writes. ``tenant`` is the
    default of every call's ``tenant=``.

    retries bounds the retries of one call (and the reconnections in a row
    of an event stream); backoff is the first delay, doubled on each retry
    up to max_backoff, with jitter, and never shorter than a Retry-After.
    """

    def __init__(self, gateway: Optional[str] = None, *, token: Optional[str] = None,
                 token_file: Optional[str] = None, tenant: Optional[str] = None, ca_file: Optional[str] = None,
                 timeout: float = 30.0, retries: int = 4, backoff: float = 0.1, max_backoff: float = 5.0,
                 stream_read_timeout: float = 45.0, env: Optional[Mapping[str, str]] = None,
                 config_dir: Optional[str] = None) -> None:
        s = auth.resolve(gateway, token, tenant, ca_file, env, config_dir, token_file)
        u = urllib.parse.urlsplit(s.gateway)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigurationError(f"gateway {s.gateway!r}: want http(s)://host[:port]")
        self.gateway = s.gateway
        self.tenant = s.tenant
        self._token = s.token
        self._host = u.hostname
        self._port = u.port
        self._prefix = u.path.rstrip("/")
        self._ssl: Optional[ssl.SSLContext] = None
        if u.scheme == "https":
            if s.ca_file and not os.path.isfile(s.ca_file):
                raise ConfigurationError(f"CA file {s.ca_file} does not exist")
            self._ssl = ssl.create_default_context(cafile=s.ca_file or None)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        # An event stream sends a comment every 15 s while idle: three
        # missed in a row mean the connection is dead, so reconnect.
        self.stream_read_timeout = stream_read_timeout
        # Tests replace these to observe the delays.
        self.sleep: Callable[[float], None] = time.sleep
        self.random: Callable[[], float] = random.random

    # --- transport ---

    def _delay(self, attempt: int, retry_after: Optional[float] = None) -> float:
        """Exponential backoff with jitter: between half and all of
        backoff*2^attempt (capped), never below Retry-After (capped at a
        minute)."""
        d = min(self.max_backoff, self.backoff * float(2 ** attempt))
        d = d / 2 + self.random() * d / 2
        if retry_after is not None:
            d = max(d, min(retry_after, 60.0))
        return d

    def _connection(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        if self._ssl is not None:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._ssl)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _path(self, path: str, query: Optional[Mapping[str, Any]]) -> str:
        q = {k: v for k, v in (query or {}).items() if v is not None}
        return self._prefix + path + ("?" + urllib.parse.urlencode(q) if q else "")

    def _send(self, method: str, path: str, *, query: Optional[Mapping[str, Any]] = None,
              body: Optional[bytes] = None, headers: Optional[Mapping[str, str]] = None,
              timeout: Optional[float] = None, stream: bool = False,
              retry: bool = True) -> tuple[_Stream, Optional[_Answer]]:
        """Sends a request, retrying what can be retried. A 2xx answer is
        read in full (inside the retries: a body cut short is retried too)
        unless stream is set: then the response is returned open and the
        caller closes the connection. An error answer raises its APIError."""
        url = self._path(path, query)
        h = {"Accept": "application/json", "User-Agent": "gpuplane-python/0.1"}
        if self._token:
            h["Authorization"] = "Bearer " + self._token
        if body is not None:
            h["Content-Type"] = "application/json"
        h.update(headers or {})
        attempt = 0
        while True:
            conn = self._connection(self.timeout if timeout is None else timeout)
            try:
                conn.request(method, url, body=body, headers=h)
                # The socket, kept before the response may take it over: a
                # stream's reads get their own timeouts.
                sock = conn.sock
                resp = conn.getresponse()
                if resp.status < 400 and stream:
                    return _Stream(conn, resp, sock), None
                data = resp.read()
            except ssl.SSLCertVerificationError as e:
                conn.close()  # a certificate does not get better by asking again
                raise TransportError(f"{method} {self.gateway}{url}: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if retry and attempt < self.retries:
                    self.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise TransportError(f"{method} {self.gateway}{url}: {e!r} (after {attempt + 1} tries)") from e
            conn.close()
            if resp.status < 400:
                return _Stream(conn, resp, None), _Answer(resp.status, resp.headers, data)
            err = api_error(resp.status, data, resp.getheader("Retry-After"))
            if retry and resp.status in RETRY_STATUSES and attempt < self.retries:
                self.sleep(self._delay(attempt, err.retry_after))
                attempt += 1
                continue
            raise err

    def _json(self, method: str, path: str, cls: type[T], *, query: Optional[Mapping[str, Any]] = None,
              body: Any = None) -> T:
        """A call answered with a JSON object, decoded into cls."""
        data = None if body is None else json.dumps(body).encode("utf-8")
        _, ans = self._send(method, path, query=query, body=data)
        assert ans is not None
        try:
            return from_dict(cls, json.loads(ans.body.decode("utf-8")))
        except ValueError as e:
            raise TransportError(f"{method} {path}: the answer is not a {cls.__name__}: {e}") from e

    def _tenant(self, tenant: Optional[str]) -> str:
        return tenant or self.tenant

    def _job_path(self, tenant: Optional[str], job_id: str, tail: str = "") -> str:
        return f"/v1/tenants/{_q(self._tenant(tenant))}/jobs/{_q(job_id)}{tail}"

    # --- jobs ---

    def health(self) -> dict[str, Any]:
        """GET /healthz: {"status": "ok"} once the gateway is ready; an
        UnavailableError (after the retries) while it catches up."""
        _, ans = self._send("GET", "/healthz")
        assert ans is not None
        doc: dict[str, Any] = json.loads(ans.body.decode("utf-8"))
        return doc

    def submit(self, request: Optional[JobRequest] = None, *, tenant: Optional[str] = None,
               id: Optional[str] = None, name: str = "", gpus: Optional[int] = None, model: str = "",
               duration: str = "", command: Optional[list[str]] = None, image: str = "",
               args: Optional[list[str]] = None, env: Optional[dict[str, str]] = None,
               priority: str = "", pool: str = "", checkpoint: bool = False,
               labels: Optional[dict[str, str]] = None, depends_on: Optional[list[str]] = None) -> "Submission":
        """Submits a job: either a JobRequest, or the keyword arguments of
        a simple one (gpus of model running command, a container of image
        with args, or a simulated run of duration). The job ID is generated here when none is given, so the
        retries of this call are one job; submitting the same ID again is
        the same job too (``duplicate`` is then true). A generated ID is
        set on the request given."""
        simple = (name, gpus, model, duration, command, image, args, env, priority, pool, checkpoint, labels,
                  depends_on)
        if request is not None and any(v not in (None, "", False) for v in simple):
            raise TypeError("submit takes a JobRequest or the keyword arguments of one, not both")
        if request is None:
            request = JobRequest(id=id or "", name=name, priority=priority, pool=pool,
                                 resources=Resources(gpu=GPURequest(count=1 if gpus is None else gpus, model=model)),
                                 run=RunSpec(duration=duration, command=list(command or []), image=image,
                                             args=list(args or []), env=dict(env or {}), checkpoint=checkpoint),
                                 labels=dict(labels or {}), depends_on=list(depends_on or []))
        elif id:
            request.id = id
        if not request.id:
            request.id = new_job_id()
        t = tenant or request.tenant or self.tenant
        resp = self._json("POST", f"/v1/tenants/{_q(t)}/jobs", SubmitResponse, body=to_dict(request))
        return Submission(self, resp)

    def get(self, job_id: str, *, tenant: Optional[str] = None) -> JobStatus:
        """The job's status. NotFoundError until the scheduler has queued
        (or rejected) it, a moment after the submit."""
        return self._json("GET", self._job_path(tenant, job_id), JobStatus)

    def list_jobs(self, *, tenant: Optional[str] = None, state: Optional[str] = None,
                  limit: Optional[int] = None, after: Optional[str] = None) -> list[JobStatus]:
        """One page of the tenant's jobs, newest first: at most limit (1 to
        1000; the gateway's default is 100), of one state when state is
        set, starting after the job ID after (the last of the previous
        page). A page shorter than its limit is the last; iter_jobs walks
        them all."""
        page = self._json("GET", f"/v1/tenants/{_q(self._tenant(tenant))}/jobs", JobList,
                          query={"state": state, "limit": limit, "after": after})
        return list(page.jobs)

    def iter_jobs(self, *, tenant: Optional[str] = None, state: Optional[str] = None,
                  page_size: int = 100) -> Iterator[JobStatus]:
        """Every job of the tenant, newest first, fetched a page at a time."""
        after: Optional[str] = None
        while True:
            page = self.list_jobs(tenant=tenant, state=state, limit=page_size, after=after)
            yield from page
            if len(page) < page_size:
                return
            after = page[-1].job_id

    # client.list(...) reads as the API's verb; list_jobs is the same call.
    list = list_jobs

    def cancel(self, job_id: str, *, tenant: Optional[str] = None, reason: Optional[str] = None) -> SubmitResponse:
        """Asks for the job to be cancelled; the outcome arrives as its
        cancelled event. ConflictError (already_terminal) when it is over."""
        return self._json("DELETE", self._job_path(tenant, job_id), SubmitResponse, query={"reason": reason})

    def describe(self, job_id: str, *, tenant: Optional[str] = None) -> JobDescription:
        """Everything known about the job: why it waits, where it runs,
        its history."""
        return self._json("GET", self._job_path(tenant, job_id, "/describe"), JobDescription)

    def usage(self, *, tenant: Optional[str] = None) -> UsageSummary:
        return self._json("GET", f"/v1/tenants/{_q(self._tenant(tenant))}/usage", UsageSummary)

    # --- event streams ---

    def watch(self, job_id: str, *, tenant: Optional[str] = None, last_event_id: int = 0,
              timeout: Optional[float] = None) -> Generator[JobEvent, None, None]:
        """The job's events, history first, ending after the terminal one.
        A dropped stream is reopened with Last-Event-ID: no event is lost
        or repeated. With timeout, WaitTimeout is raised when the job is
        not over by then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._events(self._job_path(tenant, job_id, "/events"), last_event_id, True, deadline)

    def watch_tenant(self, *, tenant: Optional[str] = None, last_event_id: int = 0,
                     timeout: Optional[float] = None) -> Generator[JobEvent, None, None]:
        """Every event of the tenant's jobs, history first, without end
        (reconnecting as watch does); stop iterating (or close() it) to
        close the stream. With timeout, WaitTimeout ends it then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._events(f"/v1/tenants/{_q(self._tenant(tenant))}/events", last_event_id, False, deadline)

    def _events(self, path: str, last: int, until_terminal: bool,
                deadline: Optional[float]) -> Generator[JobEvent, None, None]:
        broken = 0  # reconnections in a row without an event
        while True:
            read_timeout = self.stream_read_timeout
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(f"{path}: still not over after the deadline")
                read_timeout = min(read_timeout, left)
            headers = {"Accept": "text/event-stream"}
            if last:
                headers["Last-Event-ID"] = str(last)
            st, _ = self._send("GET", path, headers=headers, timeout=read_timeout, stream=True)

            def before_read() -> None:
                # Heartbeats keep an idle stream's reads short of the read
                # timeout: the deadline bounds each read itself.
                if deadline is not None and st.sock is not None:
                    st.sock.settimeout(max(0.001, min(self.stream_read_timeout, deadline - time.monotonic())))
            try:
                for seq, data in _sse(st.resp, before_read):
                    if seq and seq <= last:
                        continue  # the gateway skips these already; belt and braces
                    ev = from_dict(JobEvent, json.loads(data))
                    ev.seq = seq
                    last, broken = max(last, seq), 0
                    yield ev
                    if until_terminal and ev.terminal:
                        return
            except (OSError, http.client.HTTPException):
                pass  # the stream broke (or went silent): reopen it below
            finally:
                st.conn.close()
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"{path}: still not over after the deadline")
            if broken >= self.retries:
                raise TransportError(f"{path}: the event stream broke {broken + 1} times in a row")
            self.sleep(self._delay(broken))
            broken += 1

    def wait(self, job_id: str, *, tenant: Optional[str] = None, timeout: Optional[float] = None) -> JobStatus:
        """Waits for the job to end and returns its final status (whatever
        the outcome: check ``state``). WaitTimeout after timeout seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        final: Optional[JobEvent] = None
        for ev in self._events(self._job_path(tenant, job_id, "/events"), 0, True, deadline):
            final = ev
        # The read model folds the same stream on its own: it may be a
        # moment behind the event just seen.
        pause = 0.02
        while True:
            try:
                st = self.get(job_id, tenant=tenant)
                if st.terminal and (final is None or st.last_seq >= final.seq):
                    return st
            except APIError as e:
                if e.status != 404:
                    raise
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeout(f"job {job_id}: over, but its status did not catch up before the deadline")
            self.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, 0.5)

    # --- run output ---

    def logs(self, job_id: str, *, tenant: Optional[str] = None, attempt: Union[int, str, None] = None,
             rank: Optional[int] = None) -> str:
        """The output of the job's run so far (its latest attempt; attempt=N
        or "all" for others; rank=N picks a machine of a gang); empty
        before the run writes anything."""
        _, ans = self._send("GET", self._job_path(tenant, job_id, "/logs"),
                               query={"attempt": attempt, "rank": rank}, headers={"Accept": "text/plain"})
        assert ans is not None
        return ans.body.decode("utf-8", "replace")

    def follow_logs(self, job_id: str, *, tenant: Optional[str] = None, attempt: Union[int, str, None] = None,
                    rank: Optional[int] = None, read_timeout: Optional[float] = None) -> Generator[str, None, None]:
        """The output as it is written, until the run ends (the gateway ends
        the answer at the run's end of output). Text arrives in pieces as
        the run writes them, not in lines. The request is sent at once, so
        an error answer (404: no such job yet) raises here. The answer
        cannot resume in the middle, so a broken connection raises
        TransportError; the exit code is the job's (get()), as the log's
        trailers are beyond http.client."""
        st, _ = self._send("GET", self._job_path(tenant, job_id, "/logs"),
                           query={"attempt": attempt, "rank": rank, "follow": "true"},
                           headers={"Accept": "text/plain"}, timeout=read_timeout, stream=True)
        return _read_text(st, job_id)


def _read_text(st: _Stream, job_id: str) -> Generator[str, None, None]:
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        while True:
            try:
                chunk = st.resp.read1(65536)
            except (OSError, http.client.HTTPException) as e:
                raise TransportError(f"following the output of {job_id}: {e!r}") from e
            if not chunk:
                tail = dec.decode(b"", final=True)
                if tail:
                    yield tail
                return
            text = dec.decode(chunk)
            if text:
                yield text
    finally:
        st.conn.close()


def _sse(resp: http.client.HTTPResponse, before_read: Callable[[], None]) -> Iterator[tuple[int, str]]:
    """The (id, data) of each complete server-sent event of resp; comment
    lines (heartbeats) are skipped and an event cut short is dropped.
    before_read is called before each line is read."""
    data: list[str] = []
    seq = 0
    while True:
        before_read()
        raw = resp.readline()
        if not raw:
            return
        line = raw.decode("utf-8").rstrip("\r\n")
        if line == "":
            if data:
                yield seq, "\n".join(data)
            data, seq = [], 0
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "id":
            try:
                seq = int(value)
            except ValueError:
                seq = 0


class Submission:
    """An accepted submit: the request is on the bus, and the job's ID is
    known. ``wait()`` follows it to its end.

    The gateway knows a job only once the scheduler has queued (or
    rejected) it, a moment after the submit: until then its reads answer
    404. The methods here wait for that moment (at most appear_timeout
    seconds) instead, since this job was accepted."""

    appear_timeout = 30.0

    def __init__(self, client: Client, response: SubmitResponse) -> None:
        self.client = client
        self.response = response
        self.tenant = response.tenant
        self.job_id = response.job_id
        # True when the gateway had the request already (a repeat).
        self.duplicate = response.duplicate
        self._known = False

    def __repr__(self) -> str:
        return f"Submission(tenant={self.tenant!r}, job_id={self.job_id!r}, duplicate={self.duplicate})"

    def _when_known(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.appear_timeout
        pause = 0.02
        while True:
            try:
                out = call()
                self._known = True
                return out
            except APIError as e:
                if self._known or e.status != 404 or time.monotonic() >= deadline:
                    raise
            self.client.sleep(pause)
            pause = min(pause * 2, 0.5)

    def wait(self, timeout: Optional[float] = None) -> JobStatus:
        return self.client.wait(self.job_id, tenant=self.tenant, timeout=timeout)

    def watch(self, timeout: Optional[float] = None) -> Generator[JobEvent, None, None]:
        return self.client.watch(self.job_id, tenant=self.tenant, timeout=timeout)

    def get(self) -> JobStatus:
        return self._when_known(lambda: self.client.get(self.job_id, tenant=self.tenant))

    def describe(self) -> JobDescription:
        return self._when_known(lambda: self.client.describe(self.job_id, tenant=self.tenant))

    def logs(self) -> str:
        return self._when_known(lambda: self.client.logs(self.job_id, tenant=self.tenant))

    def follow_logs(self) -> Generator[str, None, None]:
        # follow_logs sends its request at once: a 404 is retried here.
        return self._when_known(lambda: self.client.follow_logs(self.job_id, tenant=self.tenant))

    def cancel(self, reason: Optional[str] = None) -> SubmitResponse:
        return self._when_known(lambda: self.client.cancel(self.job_id, tenant=self.tenant, reason=reason))
