"""Errors of the SDK.

Every error the gateway answers is an APIError body (contracts.APIError):
a stable, machine-readable reason code (contracts/reasons.go: a code is
never renamed, only added), a message for people and, for a rejected
request, one FieldError per problem. APIError carries all three; its
subclasses sort it by HTTP status so a caller can catch what it handles
(``except NotFoundError``) and switch on ``reason`` for the rest.
"""

from __future__ import annotations

import json
from typing import Optional

from .models import APIErrorBody, FieldError, from_dict


class GpuplaneError(Exception):
    """Base of every error this SDK raises."""


class TransportError(GpuplaneError):
    """The gateway could not be reached or the connection broke, and
    retrying (where the call is safe to retry) did not help."""


class WaitTimeout(GpuplaneError, TimeoutError):
    """A wait or watch ran past its deadline; the job is not finished."""


class ConfigurationError(GpuplaneError):
    """The client cannot be set up: no token, an unreadable credentials
    file, a CA file that does not exist."""


class APIError(GpuplaneError):
    """An error answer of the gateway."""

    def __init__(self, status: int, reason: str, message: str, fields: Optional[list[FieldError]] = None,
                 retry_after: Optional[float] = None) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.fields: list[FieldError] = list(fields or [])
        # Retry-After of a 429 or 503, in seconds; None when absent.
        self.retry_after = retry_after
        super().__init__(str(self))

    def __str__(self) -> str:
        s = f"{self.status} {self.reason}: {self.message}"
        for f in self.fields:
            s += f"\n  {f.field}: {f.reason}: {f.message}" if f.field else f"\n  {f.reason}: {f.message}"
        return s

    def field_reasons(self) -> dict[str, str]:
        """The reason code of each field error, by field."""
        return {f.field: f.reason for f in self.fields}


class InvalidRequestError(APIError):
    """400, 413 or 415: the request is wrong; ``fields`` says where."""


class UnauthenticatedError(APIError):
    """401: no token, or one the gateway does not accept."""


class PermissionDeniedError(APIError):
    """403: the token's roles do not allow this."""


class NotFoundError(APIError):
    """404: no such job (yet: a job appears once the scheduler queued or
    rejected it), node or path."""


class ConflictError(APIError):
    """409: for example cancelling a job that is already terminal."""


class RateLimitedError(APIError):
    """429: over the tenant's request rate or stream count."""


class ServerError(APIError):
    """5xx: the gateway or something behind it failed."""


class UnavailableError(ServerError):
    """503: the bus or the read model is not ready; retry shortly."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: InvalidRequestError,
    401: UnauthenticatedError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: InvalidRequestError,
    415: InvalidRequestError,
    429: RateLimitedError,
    503: UnavailableError,
}


def error_class(status: int) -> type[APIError]:
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return ServerError if status >= 500 else APIError


def parse_retry_after(v: Optional[str]) -> Optional[float]:
    """Retry-After in seconds (the gateway sends whole seconds); an HTTP
    date or garbage is ignored."""
    if not v:
        return None
    try:
        return max(0.0, float(v.strip()))
    except ValueError:
        return None


def api_error(status: int, body: bytes, retry_after: Optional[str] = None) -> APIError:
    """The APIError of an error answer. A body that is not the gateway's
    (a proxy's HTML page) keeps the status with reason ``http_<status>``."""
    cls = error_class(status)
    try:
        doc = json.loads(body.decode("utf-8"))
        b = from_dict(APIErrorBody, doc["error"])
        return cls(status, b.reason, b.message, b.fields, parse_retry_after(retry_after))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        text = body.decode("utf-8", "replace").strip()[:200]
        return cls(status, f"http_{status}", text or f"HTTP {status}", None, parse_retry_after(retry_after))
