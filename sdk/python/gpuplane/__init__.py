"""gpuplane: a Python client of the gpuplane gateway's REST API.

    import gpuplane
    client = gpuplane.Client()          # gpuctl's login, or $GPUPLANE_GATEWAY / $GPUPLANE_TOKEN
    job = client.submit(tenant="acme", gpus=1, model="L4", command=["nvidia-smi"]).wait(timeout=600)
    print(job.state, job.exit_code, client.logs(job.job_id, tenant="acme"))

Only the standard library is used (Debian's python3, 3.11 or newer).
"""

from .client import Client, Submission, new_job_id
from .errors import (APIError, ConfigurationError, ConflictError, GpuplaneError, InvalidRequestError,
                     NotFoundError, PermissionDeniedError, RateLimitedError, ServerError, TransportError,
                     UnauthenticatedError, UnavailableError, WaitTimeout)
from .models import (TERMINAL_STATES, APIErrorBody, DeviceRef, EventSummary, FieldError, GPURequest, GPUShare, Job,
                     JobDescription, JobEvent, JobList, JobRequest, JobStatus, MIGInstance, Migration, Mount,
                     PendingStatus, Placement, PullProgress, Resources, RunSpec, SubmitResponse, Toleration,
                     UsageRecord, UsageSummary)

__all__ = [
    "Client", "Submission", "new_job_id",
    "APIError", "ConfigurationError", "ConflictError", "GpuplaneError", "InvalidRequestError", "NotFoundError",
    "PermissionDeniedError", "RateLimitedError", "ServerError", "TransportError", "UnauthenticatedError",
    "UnavailableError", "WaitTimeout",
    "TERMINAL_STATES", "APIErrorBody", "DeviceRef", "EventSummary", "FieldError", "GPURequest", "GPUShare", "Job",
    "JobDescription", "JobEvent", "JobList", "JobRequest", "JobStatus", "MIGInstance", "Migration", "Mount",
    "PendingStatus", "Placement", "PullProgress", "Resources", "RunSpec", "SubmitResponse", "Toleration",
    "UsageRecord", "UsageSummary",
]
