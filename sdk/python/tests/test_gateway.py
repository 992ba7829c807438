"""The SDK against a real gateway: the all-in-one binary, started once for
the class on free ports with a fresh data directory and a small simulated
fleet, stopped (and its directory removed) even when a test fails."""

from __future__ import annotations

import re
import unittest
from typing import Optional

import gpuplane
from gpuplane import models

from harness import Platform, Proxy, eventually

WAIT = 30.0  # bound of every wait for a job: the runs below take a second


class GatewayTest(unittest.TestCase):
    platform: Platform
    client: gpuplane.Client

    @classmethod
    def setUpClass(cls) -> None:
        cls.platform = Platform()
        cls.addClassCleanup(cls.platform.stop)
        cls.platform.start()
        # The demo user, a member of acme, as a data scientist would be.
        cls.client = gpuplane.Client(cls.platform.gateway, token=cls.platform.token("demo-acme"), tenant="acme",
                                     env={})
        eventually("the gateway to be ready", cls._ready, timeout=60)

    @classmethod
    def _ready(cls) -> bool:
        try:
            return cls.client.health().get("status") == "ok"
        except gpuplane.GpuplaneError:
            return False

    def test_submit_watch_logs(self) -> None:
        sub = self.client.submit(gpus=1, model="L4", command=["sh", "-c", "echo hello from $CUDA_VISIBLE_DEVICES; echo bye"])
        # The client made the ID (a ULID, like the gateway's own), so a
        # retried submit is this job.
        self.assertRegex(sub.job_id, r"^[0-9A-HJKMNP-TV-Z]{26}$")
        self.assertFalse(sub.duplicate)
        events = list(sub.watch(timeout=WAIT))
        types = [e.type for e in events]
        self.assertEqual(types[0], "queued", types)
        self.assertEqual(types[-1], "succeeded", types)
        self.assertIn("running", types)
        seqs = [e.seq for e in events]
        self.assertEqual(seqs, sorted(set(seqs)), "event sequences must rise strictly")
        queued = events[0]
        self.assertIsNotNone(queued.request)
        assert queued.request is not None
        self.assertEqual(queued.request.id, sub.job_id)
        self.assertEqual(queued.request.run.command[0], "sh")
        running = next(e for e in events if e.type == "running")
        assert running.placement is not None
        self.assertEqual(running.placement.devices[0].model, "L4")

        job = sub.wait(timeout=WAIT)
        self.assertIsInstance(job, models.JobStatus)
        self.assertEqual((job.state, job.exit_code, job.attempt), ("succeeded", 0, 1))
        self.assertIsNotNone(job.ended_at)
        self.assertEqual(job.last_seq, events[-1].seq)

        gpu = running.placement.devices[0].uuid
        self.assertEqual(self.client.logs(sub.job_id), f"hello from {gpu}\nbye\n")

        desc = sub.describe()
        self.assertEqual([e.type for e in desc.events], types)
        self.assertEqual(desc.state, "succeeded")
        self.assertIn(sub.job_id, [j.job_id for j in self.client.list(state="succeeded", limit=1000)])

        # Usage is metered by billing on its own: bounded wait for it.
        def metered() -> bool:
            return any(r.job_id == sub.job_id and r.final for r in self.client.usage().by_job)
        eventually("the job's final usage record", metered)
        rec = next(r for r in self.client.usage().by_job if r.job_id == sub.job_id and r.final)
        self.assertEqual((rec.gpus, rec.gpu_model, rec.tenant), (1, "L4", "acme"))
        self.assertGreater(rec.gpu_millis, 0)

    def test_follow_logs_until_the_end(self) -> None:
        sub = self.client.submit(gpus=1, model="L4", command=["sh", "-c", "echo one; sleep 1; echo two"])
        # Started before the run has written (or even started): the
        # answer waits for the output and ends with the run.
        out = "".join(sub.follow_logs())
        self.assertEqual(out, "one\ntwo\n")
        self.assertEqual(sub.wait(timeout=WAIT).exit_code, 0)

    def test_cancel_a_running_job(self) -> None:
        sub = self.client.submit(name="long", gpus=1, model="L4", duration="10m")
        seen: list[str] = []
        for ev in sub.watch(timeout=WAIT):
            seen.append(ev.type)
            if ev.type == "running":
                ack = sub.cancel(reason="test over")
                self.assertEqual(ack.job_id, sub.job_id)
        self.assertEqual(seen[-1], "cancelled", seen)
        job = sub.wait(timeout=WAIT)
        self.assertEqual(job.state, "cancelled")
        with self.assertRaises(gpuplane.ConflictError) as cm:
            sub.cancel()
        self.assertEqual((cm.exception.status, cm.exception.reason), (409, "already_terminal"))

    def test_rejected_request_has_field_errors(self) -> None:
        req = models.JobRequest(id="bad id", resources=models.Resources(gpu=models.GPURequest(count=0, model="X")),
                                run=models.RunSpec())
        with self.assertRaises(gpuplane.InvalidRequestError) as cm:
            self.client.submit(req)
        e = cm.exception
        self.assertEqual((e.status, e.reason), (400, "invalid_request"))
        self.assertEqual(e.field_reasons(), {
            "id": "invalid_id",
            "resources.gpu.count": "out_of_range",
            "resources.gpu.model": "unknown_gpu_model",
            "run": "missing_field",
        })
        self.assertIn("gpu count is 0", str(e))

    def test_unsatisfiable_job_waits_and_says_why(self) -> None:
        # Valid to the gateway, more than this fleet will ever have: the
        # job stays queued, describe says why, and a wait runs out.
        sub = self.client.submit(gpus=64, model="L4", duration="1s")
        with self.assertRaises(gpuplane.WaitTimeout):
            sub.wait(timeout=1)

        def pending() -> Optional[models.PendingStatus]:
            try:
                return sub.describe().pending
            except gpuplane.NotFoundError:
                return None
        eventually("the scheduler's pending reason", lambda: pending() is not None)
        desc = sub.describe()
        assert desc.pending is not None
        self.assertEqual((desc.state, desc.pending.reason), ("queued", "unsatisfiable"))
        sub.cancel(reason="cannot run here")
        job = sub.wait(timeout=WAIT)
        self.assertEqual(job.state, "cancelled")

    def test_submit_is_idempotent_by_id(self) -> None:
        first = self.client.submit(id="py-same-id", gpus=1, model="L4", duration="1s")
        again = self.client.submit(id="py-same-id", gpus=1, model="L4", duration="1s")
        self.assertEqual((first.duplicate, again.duplicate), (False, True))
        self.assertEqual(again.wait(timeout=WAIT).attempt, 1)

    def test_list_pages_through_every_job(self) -> None:
        ids = [self.client.submit(id=f"py-page-{i}", gpus=1, model="L4", duration="1s").job_id for i in range(5)]
        for i in ids:
            self.client.wait(i, timeout=WAIT)
        everything = [j.job_id for j in self.client.list(limit=1000)]
        self.assertTrue(set(ids) <= set(everything), everything)
        paged = [j.job_id for j in self.client.iter_jobs(page_size=2)]
        self.assertEqual(paged, everything, "pages of 2 must give the one list, in order, once each")
        self.assertEqual(len(self.client.list(limit=2, after=everything[0])), 2)
        with self.assertRaises(gpuplane.InvalidRequestError) as cm:
            self.client.list(after="no-such-job")
        self.assertEqual(cm.exception.field_reasons(), {"after": "unknown_job"})

    def test_watch_tenant_sees_every_job(self) -> None:
        subs = [self.client.submit(gpus=1, model="L4", duration="1s") for _ in range(2)]
        waiting = {s.job_id for s in subs}
        last = 0
        stream = self.client.watch_tenant(timeout=WAIT)
        for ev in stream:
            self.assertGreater(ev.seq, last)
            last = ev.seq
            if ev.type == "succeeded":
                waiting.discard(ev.job_id)
            if not waiting:
                break
        stream.close()  # an endless stream ends when its reader stops
        # Resuming after the last event seen gives only what came later.
        later = self.client.submit(gpus=1, model="L4", duration="1s")
        resumed = self.client.watch_tenant(last_event_id=last, timeout=WAIT)
        for ev in resumed:
            self.assertGreater(ev.seq, last)
            if ev.job_id == later.job_id:
                break
        resumed.close()
        self.assertEqual(ev.job_id, later.job_id)

    def test_errors_by_status(self) -> None:
        cases: list[tuple[str, gpuplane.Client, type[gpuplane.APIError], int, str]] = [
            ("unknown job", self.client, gpuplane.NotFoundError, 404, "unknown_job"),
            ("bad token", gpuplane.Client(self.platform.gateway, token="gpt_nobody_x", tenant="acme", env={},
                                          retries=0), gpuplane.UnauthenticatedError, 401, "invalid_token"),
            ("another tenant", gpuplane.Client(self.platform.gateway, token=self.platform.token("demo-acme"),
                                               tenant="globex", env={}), gpuplane.PermissionDeniedError, 403,
             "forbidden"),
        ]
        for name, client, cls, status, reason in cases:
            with self.subTest(name):
                with self.assertRaises(cls) as cm:
                    client.get("no-such-job")
                self.assertIsInstance(cm.exception, gpuplane.APIError)
                self.assertEqual((cm.exception.status, cm.exception.reason), (status, reason))

    def test_credentials_file_of_gpuctl_login(self) -> None:
        # make run logs gpuctl in as the local platform admin: a client
        # with no settings but that directory reaches the gateway as admin.
        admin = gpuplane.Client(env={"GPUPLANE_CONFIG_DIR": self.platform.gpuctl_dir})
        self.assertEqual(admin.gateway, self.platform.gateway)
        self.assertEqual(admin.usage(tenant="acme").tenant, "acme")

    def test_submit_retried_after_the_answer_was_lost(self) -> None:
        # The first connection's request reaches the gateway, its answer
        # is dropped: the client sends it again with the same ID, and the
        # gateway reports the repeat; there is one job.
        proxy = Proxy(self.platform.gateway, lambda n, sent: 0 if n == 0 else None)
        self.addCleanup(proxy.close)
        c = gpuplane.Client(proxy.url, token=self.platform.token("demo-acme"), tenant="acme", env={})
        sub = c.submit(gpus=1, model="L4", duration="1s")
        self.assertEqual(proxy.connections(), 2)
        self.assertTrue(sub.duplicate, "the retry must be de-duplicated by the job ID")
        ids = {re.search(rb'"id": ?"([^"]+)"', r).group(1) for r in proxy.requests}  # type: ignore[union-attr]
        self.assertEqual(ids, {sub.job_id.encode()})
        job = self.client.wait(sub.job_id, timeout=WAIT)
        self.assertEqual((job.state, job.attempt), ("succeeded", 1))

    def test_watch_resumes_after_a_dropped_stream(self) -> None:
        sub = self.client.submit(gpus=1, model="L4", duration="1s")
        self.client.wait(sub.job_id, timeout=WAIT)

        def cut(n: int, sent: bytes) -> Optional[int]:
            # The first stream breaks right after its first event.
            if n != 0:
                return None
            i = sent.find(b"\nid: ")
            j = sent.find(b"\n\n", i) if i >= 0 else -1
            return j + 2 if j >= 0 else None
        proxy = Proxy(self.platform.gateway, cut)
        self.addCleanup(proxy.close)
        c = gpuplane.Client(proxy.url, token=self.platform.token("demo-acme"), tenant="acme", env={})
        resumed = list(c.watch(sub.job_id, timeout=WAIT))
        direct = list(self.client.watch(sub.job_id, timeout=WAIT))
        self.assertEqual([(e.seq, e.type) for e in resumed], [(e.seq, e.type) for e in direct])
        self.assertEqual(proxy.connections(), 2)
        self.assertIn(b"Last-Event-ID: %d\r\n" % direct[0].seq, proxy.requests[1])


if __name__ == "__main__":
    unittest.main()
