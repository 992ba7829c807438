"""Typed messages of the gateway's REST API.

Each dataclass mirrors one type of the contracts: its attributes are the
schema's properties in snake_case (the JSON name is the camelCase one, or the
``json`` entry of the field's metadata where the contract spells it
otherwise, such as ``memoryMiB``), and a property the schema requires is a
field without a default. ``__schema__`` names the definition the class
mirrors: a ``$defs`` entry of contracts/schema/*.json or, for the API's own
answers that have no published schema yet, the Go type in contracts/. The
test tests/test_schema.py holds every class to it (names, required-ness and
types), so the SDK cannot drift from the platform.

Decoding ignores properties the SDK does not know (a newer gateway may add
some); encoding leaves out optional fields that are empty, as the platform's
own ``omitempty`` does.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional, TypeVar, Union

# Job states; the last four are terminal (contracts.JobState.Terminal).
QUEUED = "queued"
SCHEDULED = "scheduled"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
REJECTED = "rejected"
TERMINAL_STATES = frozenset({SUCCEEDED, FAILED, CANCELLED, REJECTED})

T = TypeVar("T")


def _j(name: str, **kw: Any) -> Any:
    """A field whose JSON name is not the camelCase of its attribute."""
    return field(metadata={"json": name}, **kw)


def json_name(f: dataclasses.Field[Any]) -> str:
    """The JSON property of a dataclass field."""
    if "json" in f.metadata:
        return str(f.metadata["json"])
    head, *rest = f.name.split("_")
    return head + "".join(p.capitalize() for p in rest)


def is_required(f: dataclasses.Field[Any]) -> bool:
    """Whether the contract requires the field: it has no default, or the
    client fills it in before sending (a job request's ID)."""
    no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    return no_default or bool(f.metadata.get("client_fills"))


# --- job requests (contracts/schema/job-request.json) ---


@dataclass(kw_only=True)
class GPUShare:
    """A fraction of one GPU, run under MPS with these limits."""

    __schema__ = "GPUShare"
    memory_mib: int = _j("memoryMiB")
    compute_percent: int


@dataclass(kw_only=True)
class GPURequest:
    """Whole GPUs of a model, one MIG instance, or a share of one GPU."""

    __schema__ = "GPURequest"
    count: int
    model: str = ""
    memory_mib: int = _j("memoryMiB", default=0)
    models: list[str] = field(default_factory=list)
    mig_profile: str = ""
    share: Optional[GPUShare] = None
    nodes: int = 0
    topology: str = ""


@dataclass(kw_only=True)
class Resources:
    __schema__ = "Resources"
    gpu: GPURequest
    cpu_milli: int = 0
    memory_mib: int = _j("memoryMiB", default=0)


@dataclass(kw_only=True)
class Mount:
    """A host path (under one of the pool's mount roots) in a container."""

    __schema__ = "Mount"
    source: str
    target: str
    read_only: bool = False


@dataclass(kw_only=True)
class RunSpec:
    """A simulated run (duration), a real command, or a container of an
    OCI image (image, args, working_dir, mounts, shm_size_mib, user)."""

    __schema__ = "RunSpec"
    duration: str = ""
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    image: str = ""
    args: list[str] = field(default_factory=list)
    working_dir: str = ""
    mounts: list[Mount] = field(default_factory=list)
    shm_size_mib: int = _j("shmSizeMiB", default=0)
    user: str = ""
    exit_code: int = 0
    checkpoint: bool = False


@dataclass(kw_only=True)
class Toleration:
    __schema__ = "Toleration"
    key: str = ""
    operator: str = ""
    value: str = ""
    effect: str = ""


@dataclass(kw_only=True)
class JobRequest:
    """What a tenant asks for. The ID makes a submit idempotent: the client
    generates one when it is left empty."""

    __schema__ = "JobRequest"
    id: str = field(default="", metadata={"client_fills": True})
    resources: Resources
    run: RunSpec
    schema_version: int = 0
    tenant: str = ""
    name: str = ""
    priority: str = ""
    pool: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[Toleration] = field(default_factory=list)
    depends_on: list[str] = field(default_factory=list)
    placement_timeout: str = ""
    expected_run_time: str = ""


# --- where jobs run (contracts/schema/job-event.json) ---


@dataclass(kw_only=True)
class MIGInstance:
    __schema__ = "MIGInstance"
    uuid: str
    profile: str
    gi_id: int
    ci_id: int
    start: int
    size: int
    memory_mib: int = _j("memoryMiB")


@dataclass(kw_only=True)
class DeviceRef:
    __schema__ = "DeviceRef"
    index: int
    uuid: str
    model: str
    mig: Optional[MIGInstance] = None
    share: Optional[GPUShare] = None


@dataclass(kw_only=True)
class Placement:
    __schema__ = "Placement"
    allocation_id: str
    node_id: str
    pool: str
    devices: list[DeviceRef]


@dataclass(kw_only=True)
class Migration:
    __schema__ = "Migration"
    reason: str
    from_attempt: int
    from_: list[Placement] = _j("from", default_factory=list)
    checkpoint: bool
    deadline: Optional[datetime] = None
    triggered_at: Optional[datetime] = None
    restored_from: str = ""
    checkpointed: bool = False
    keep_off: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class PullProgress:
    """How far the pull of a container run's image has come (bytes)."""

    __schema__ = "PullProgress"
    image: str
    digest: str = ""
    done: int
    total: int


@dataclass(kw_only=True)
class FieldError:
    """One problem of a request: the field (a JSON path such as
    ``resources.gpu.count``), its stable reason code and a message."""

    __schema__ = "FieldError"
    field: str
    reason: str
    message: str


@dataclass(kw_only=True)
class JobEvent:
    """One step of a job's life, as the event streams carry it."""

    __schema__ = "JobEvent"
    schema_version: int
    type: str
    tenant: str
    job_id: str
    attempt: int
    state: str
    time: datetime
    reason: str = ""
    message: str = ""
    errors: list[FieldError] = field(default_factory=list)
    request: Optional[JobRequest] = None
    submit_seq: int = 0
    placement: Optional[Placement] = None
    placements: list[Placement] = field(default_factory=list)
    exit_code: Optional[int] = None
    started_at: Optional[datetime] = None
    ended_at: Optional[datetime] = None
    migration: Optional[Migration] = None
    pull: Optional[PullProgress] = None
    # The JOB_EVENTS stream sequence of the event: the SSE id, what a
    # reconnecting watch resumes after. Not part of the message.
    seq: int = field(default=0, metadata={"transport": True})

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


# --- the gateway's answers (contracts/api.go, contracts/schedapi.go) ---


@dataclass(kw_only=True)
class SubmitResponse:
    """An accepted submit or cancel: the request is on the bus."""

    __schema__ = "SubmitResponse"
    tenant: str
    job_id: str
    stream: str
    sequence: int
    duplicate: bool


@dataclass(kw_only=True)
class JobStatus:
    """The read model of one job (GET .../jobs/{id})."""

    __schema__ = "JobStatus"
    tenant: str
    job_id: str
    name: str = ""
    state: str
    attempt: int
    reason: str = ""
    message: str = ""
    errors: list[FieldError] = field(default_factory=list)
    request: Optional[JobRequest] = None
    placement: Optional[Placement] = None
    placements: list[Placement] = field(default_factory=list)
    exit_code: Optional[int] = None
    created_at: datetime
    updated_at: datetime
    started_at: Optional[datetime] = None
    ended_at: Optional[datetime] = None
    migration: Optional[Migration] = None
    migrations: int = 0
    pull: Optional[PullProgress] = None
    last_seq: int

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


Job = JobStatus


@dataclass(kw_only=True)
class JobList:
    __schema__ = "JobList"
    jobs: list[JobStatus]


@dataclass(kw_only=True)
class PendingStatus:
    __schema__ = "PendingStatus"
    reason: str
    message: str = ""
    since: datetime


@dataclass(kw_only=True)
class EventSummary:
    __schema__ = "EventSummary"
    seq: int
    type: str
    attempt: int
    time: datetime
    reason: str = ""
    message: str = ""


@dataclass(kw_only=True)
class JobDescription:
    """Everything the platform can say about one job (GET .../describe)."""

    __schema__ = "JobDescription"
    tenant: str
    job_id: str
    name: str = ""
    state: str
    attempt: int
    pending: Optional[PendingStatus] = None
    reason: str = ""
    message: str = ""
    errors: list[FieldError] = field(default_factory=list)
    request: Optional[JobRequest] = None
    depends_on: list[str] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)
    exit_code: Optional[int] = None
    created_at: datetime
    updated_at: datetime
    started_at: Optional[datetime] = None
    ended_at: Optional[datetime] = None
    events: list[EventSummary]
    events_omitted: int = 0


@dataclass(kw_only=True)
class UsageRecord:
    """Metered GPU time of one allocation segment, priced."""

    __schema__ = "UsageRecord"
    schema_version: int
    id: str
    allocation_id: str
    tenant: str
    job_id: str
    attempt: int
    node_id: str
    pool: str
    gpu_model: str
    gpus: int
    start: datetime
    end: datetime
    gpu_millis: int
    gpu_seconds: float
    time: datetime
    segment: int = 0
    final: bool = False
    reason: str = ""
    provisional: bool = False
    voids: str = ""
    devices: list[DeviceRef] = field(default_factory=list)
    seconds: int = 0
    gpu_share: str = ""
    price_class: str = ""
    price_version: str = ""
    currency: str = ""
    unpriced: bool = False
    gpu_rate_micros: int = 0
    on_demand_rate_micros: int = 0
    cpu_milli: int = 0
    memory_mib: int = _j("memoryMiB", default=0)
    gpu_cost_micros: int = 0
    cpu_cost_micros: int = 0
    memory_cost_micros: int = 0
    cost_micros: int = 0
    on_demand_cost_micros: int = 0


@dataclass(kw_only=True)
class UsageSummary:
    """A tenant's metered usage (GET .../usage)."""

    __schema__ = "UsageSummary"
    tenant: str
    gpu_seconds: float
    gpu_millis: int
    records: int
    by_job: list[UsageRecord]
    cost_micros: int
    on_demand_cost_micros: int
    currency: str = ""


@dataclass(kw_only=True)
class APIErrorBody:
    """What the gateway says went wrong (the body's ``error``)."""

    __schema__ = "APIErrorBody"
    reason: str
    message: str
    fields: list[FieldError] = field(default_factory=list)


# Every class that mirrors a contract type, for the schema test.
MODELS: tuple[type, ...] = (
    GPUShare, GPURequest, Resources, Mount, RunSpec, Toleration, JobRequest, MIGInstance, DeviceRef,
    Placement, Migration, PullProgress, FieldError, JobEvent, SubmitResponse, JobStatus, JobList, PendingStatus,
    EventSummary, JobDescription, UsageRecord, UsageSummary, APIErrorBody,
)


def wire_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of cls that travel in its JSON (not transport ones)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("transport")]


def _hints(cls: type) -> dict[str, Any]:
    mod = vars(sys.modules[__name__])
    # The module, not the class, resolves names: a field such as
    # FieldError.field or JobEvent.type must not shadow a type.
    return typing.get_type_hints(cls, mod, mod)


def unwrap_optional(tp: Any) -> Any:
    """X for Optional[X]; tp otherwise."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def parse_time(v: str) -> datetime:
    """An RFC 3339 time as Go writes it (nanoseconds are cut to micro)."""
    s = v.strip()
    if s.endswith("Z") or s.endswith("z"):
        s = s[:-1] + "+00:00"
    if "." in s:
        # Python keeps microseconds: cut the fraction to 6 digits.
        head, rest = s.split(".", 1)
        digits = len(rest) - len(rest.lstrip("0123456789"))
        s = head + "." + (rest[:digits][:6] or "0") + rest[digits:]
    return datetime.fromisoformat(s)


def format_time(t: datetime) -> str:
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.isoformat().replace("+00:00", "Z")


def _decode(tp: Any, v: Any) -> Any:
    if v is None:
        return None
    tp = unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_decode(item, x) for x in v]
    if origin is dict:
        _, val = typing.get_args(tp)
        return {str(k): _decode(val, x) for k, x in v.items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_dict(tp, v)
    if tp is datetime:
        return parse_time(v)
    if tp is float:
        return float(v)
    return v


def from_dict(cls: type[T], data: Any) -> T:
    """Decodes a JSON object into cls; unknown properties are ignored and a
    missing required one is a ValueError."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: want a JSON object, got {type(data).__name__}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in wire_fields(cls):
        name = json_name(f)
        if name in data:
            kwargs[f.name] = _decode(hints[f.name], data[name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}: the answer lacks the required property {name!r}")
    return cls(**kwargs)


def _encode(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_dict(v)
    if isinstance(v, datetime):
        return format_time(v)
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _encode(x) for k, x in v.items()}
    return v


def to_dict(obj: Any) -> dict[str, Any]:
    """Encodes a dataclass as the contract's JSON object: required fields
    always, optional ones only when set (Go's omitempty)."""
    out: dict[str, Any] = {}
    for f in wire_fields(type(obj)):
        v = getattr(obj, f.name)
        if not is_required(f) and (v is None or (v == f.default if f.default is not dataclasses.MISSING else not v)):
            continue
        out[json_name(f)] = _encode(v)
    return out
