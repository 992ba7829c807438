"""Where a client's gateway, token, tenant and CA come from: the places and
order gpuctl uses (its credentials file, GPUPLANE_* variables)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import unittest

from gpuplane import auth
from gpuplane.errors import ConfigurationError


class ResolveTest(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="gpuplane-pysdk-auth-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.gpuctl = os.path.join(self.dir, "gpuplane")
        os.makedirs(self.gpuctl)
        # What gpuctl login writes (services/gpuctl/credentials.go).
        with open(os.path.join(self.gpuctl, "credentials.json"), "w", encoding="utf-8") as f:
            json.dump({"current": "https://gw.example:8443", "gateways": {
                "https://gw.example:8443": {"token": "tok-current", "method": "oidc", "tenant": "acme",
                                            "caCert": "/etc/ca.pem", "expiresAt": "2030-01-01T00:00:00Z"},
                "http://other:8080": {"token": "tok-other", "method": "token"},
            }}, f)
        self.token_file = os.path.join(self.dir, "demo.token")
        with open(self.token_file, "w", encoding="utf-8") as f:
            f.write("tok-file\n")

    def test_order(self) -> None:
        cfg = {"GPUPLANE_CONFIG_DIR": self.gpuctl}
        cases: list[tuple[str, dict[str, str], dict[str, str], auth.Settings]] = [
            ("the login alone", {}, cfg,
             auth.Settings("https://gw.example:8443", "tok-current", "acme", "/etc/ca.pem")),
            ("XDG_CONFIG_HOME finds the same file", {}, {"XDG_CONFIG_HOME": self.dir},
             auth.Settings("https://gw.example:8443", "tok-current", "acme", "/etc/ca.pem")),
            ("HOME/.config when nothing else", {}, {"HOME": "/nonexistent"},
             auth.Settings(auth.DEFAULT_GATEWAY, "", "default", "")),
            ("another gateway takes its own login", {"gateway": "http://other:8080/"}, cfg,
             auth.Settings("http://other:8080", "tok-other", "default", "")),
            ("environment over the login", {}, {**cfg, "GPUPLANE_GATEWAY": "http://other:8080",
                                                "GPUPLANE_TOKEN": "tok-env", "GPUPLANE_TENANT": "globex",
                                                "GPUPLANE_CA_CERT": "/env/ca.pem"},
             auth.Settings("http://other:8080", "tok-env", "globex", "/env/ca.pem")),
            ("arguments over everything", {"gateway": "http://arg:1", "token": "tok-arg", "tenant": "t",
                                           "ca_file": "/arg.pem"}, {**cfg, "GPUPLANE_TOKEN": "tok-env"},
             auth.Settings("http://arg:1", "tok-arg", "t", "/arg.pem")),
            ("a token file stands for the token", {"token_file": self.token_file}, {**cfg, "GPUPLANE_TOKEN": "x"},
             auth.Settings("https://gw.example:8443", "tok-file", "acme", "/etc/ca.pem")),
        ]
        for name, args, env, want in cases:
            with self.subTest(name):
                self.assertEqual(auth.resolve(env=env, **args), want)

    def test_unreadable(self) -> None:
        with open(os.path.join(self.gpuctl, "credentials.json"), "w", encoding="utf-8") as f:
            f.write("{not json")
        with self.assertRaises(ConfigurationError):
            auth.resolve(env={"GPUPLANE_CONFIG_DIR": self.gpuctl})
        with self.assertRaises(ConfigurationError):
            auth.resolve(env={}, token_file=os.path.join(self.dir, "missing.token"))


if __name__ == "__main__":
    unittest.main()
