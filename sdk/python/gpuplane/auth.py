"""Where the client's gateway, token, tenant and CA come from.

The same places gpuctl reads (services/gpuctl/gpuctl.go defaults and
credentials.go), in the same order, so a user logged in with ``gpuctl
login`` (or by ``make run``) needs nothing more:

- gateway: the argument, else $GPUPLANE_GATEWAY, else the credentials
  file's current gateway, else http://127.0.0.1:8080;
- token: the argument (or the token_file argument), else $GPUPLANE_TOKEN, else the credentials file's
  token for that gateway;
- tenant: the argument, else $GPUPLANE_TENANT, else the login's tenant,
  else "default";
- CA file: the argument, else $GPUPLANE_CA_CERT, else the login's caCert.

The credentials file is credentials.json in $GPUPLANE_CONFIG_DIR, else in
gpuplane/ under the user's configuration directory ($XDG_CONFIG_HOME or
~/.config on Linux, as Go's os.UserConfigDir).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from .errors import ConfigurationError

DEFAULT_GATEWAY = "http://127.0.0.1:8080"


def config_dir(env: Mapping[str, str]) -> Optional[str]:
    """gpuctl's configuration directory; None when there is none."""
    if env.get("GPUPLANE_CONFIG_DIR"):
        return env["GPUPLANE_CONFIG_DIR"]
    base = env.get("XDG_CONFIG_HOME")
    if not base:
        home = env.get("HOME")
        if not home:
            return None
        base = os.path.join(home, ".config")
    return os.path.join(base, "gpuplane")


def credentials_file(directory: str) -> str:
    return os.path.join(directory, "credentials.json")


@dataclass
class Credential:
    """One gateway's login, as gpuctl stores it."""

    token: str = ""
    method: str = ""
    subject: str = ""
    tenant: str = ""
    ca_cert: str = ""


@dataclass
class Credentials:
    current: str = ""
    gateways: Optional[dict[str, Credential]] = None

    def login(self, gateway: str) -> Credential:
        return (self.gateways or {}).get(gateway.rstrip("/"), Credential())


def load_credentials(directory: Optional[str]) -> Credentials:
    """Reads credentials.json in directory; a missing file is no login."""
    if not directory:
        return Credentials(gateways={})
    path = credentials_file(directory)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return Credentials(gateways={})
    except (OSError, ValueError) as e:
        raise ConfigurationError(f"credentials {path}: {e}") from e
    gateways: dict[str, Credential] = {}
    for gw, c in (doc.get("gateways") or {}).items():
        gateways[gw.rstrip("/")] = Credential(token=c.get("token", ""), method=c.get("method", ""),
                                              subject=c.get("subject", ""), tenant=c.get("tenant", ""),
                                              ca_cert=c.get("caCert", ""))
    return Credentials(current=doc.get("current", ""), gateways=gateways)


@dataclass
class Settings:
    """What a Client connects with, once resolved."""

    gateway: str
    token: str
    tenant: str
    ca_file: str


def read_token_file(path: str) -> str:
    """A token kept alone in a file (make run's tokens/admin.token)."""
    try:
        with open(path, encoding="utf-8") as f:
            tok = f.read().strip()
    except OSError as e:
        raise ConfigurationError(f"token file: {e}") from e
    if not tok:
        raise ConfigurationError(f"token file {path} is empty")
    return tok


def resolve(gateway: Optional[str] = None, token: Optional[str] = None, tenant: Optional[str] = None,
            ca_file: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
            config_directory: Optional[str] = None, token_file: Optional[str] = None) -> Settings:
    """Resolves the settings as gpuctl does (see the module's doc); a
    token_file given stands for the token argument."""
    e: Mapping[str, str] = os.environ if env is None else env
    if not token and token_file:
        token = read_token_file(token_file)
    creds = load_credentials(config_directory if config_directory is not None else config_dir(e))
    gw = (gateway or e.get("GPUPLANE_GATEWAY") or creds.current or DEFAULT_GATEWAY).rstrip("/")
    login = creds.login(gw)
    return Settings(
        gateway=gw,
        token=token or e.get("GPUPLANE_TOKEN") or login.token,
        tenant=tenant or e.get("GPUPLANE_TENANT") or login.tenant or "default",
        ca_file=ca_file or e.get("GPUPLANE_CA_CERT") or login.ca_cert,
    )
