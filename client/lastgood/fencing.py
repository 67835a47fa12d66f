"""The fencing contract that client and service share (torch-free).

Every launch of a job registers with the service (POST /api/v1/runs/{run}/launches, one
call per rank, idempotent on (run, attempt)) and gets its run's next generation. Once a
newer generation has registered, the service refuses every write of an older one: begin,
put and vote (gRPC FAILED_PRECONDITION) and tags, pins and rollbacks (HTTP 409). It marks
such a refusal with the error code FENCED, in the REST error body (`error.code`) and in
the gRPC trailing metadata under ERROR_METADATA, so the client can tell "a newer launch
owns this run" (errors.Fenced: stop training) from any other refusal. See docs/fencing.md.
"""

from __future__ import annotations

# the REST header that carries the caller's generation on the curation routes
GENERATION_HEADER = "Lastgood-Generation"
# the gRPC trailing metadata key holding a refusal's error code, and the error code of a
# write refused because a newer launch of the run has registered: errors.py owns both
from .errors import ERROR_METADATA, FENCED  # noqa: E402,F401
