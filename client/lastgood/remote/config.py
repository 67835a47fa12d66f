"""The client's settings, resolved once: explicit arguments first, then the environment.

Every LASTGOOD_* variable the client reads is named here and nowhere else; the
Checkpointer, the DCP adapter and the command line build a ClientConfig and pass its
fields down (the transport, the retry policy, the run and attempt). torch-free.

    LASTGOOD_URL              the service's REST base URL
    LASTGOOD_TOKEN            bearer token, for a service that requires one
    LASTGOOD_RUN              the run to save to and restore from
    LASTGOOD_ATTEMPT          this launch's attempt id, the same on every rank (else drawn)
    LASTGOOD_NEW_RUN          1: accept a run name torchrun --standalone drew at random
    LASTGOOD_USE_SPOOL        0: never hand shards over through the service's spool; stream
                              (LASTGOOD_SPOOL, the service's own switch, is read too, with a warning)
    LASTGOOD_DEDUP            0: every rank writes its replicated (DDP) state too (replicas.py)
    LASTGOOD_DDP_BUCKETS      0: neither save DDP's gradient-bucket layout nor resume in it
                              (state/ddp_buckets.py)
    LASTGOOD_DIRECT_FS_MOUNT  where this host mounts the service's local store directory (direct-FS)
    LASTGOOD_RETRY_DEADLINE   seconds one call keeps retrying (default 120; 0 = no retries)
    LASTGOOD_RETRY_INITIAL    first backoff in seconds (default 0.1)
    LASTGOOD_RETRY_MAX_DELAY  longest backoff in seconds (default 2.0)
    LASTGOOD_HEARTBEAT_SECONDS  seconds between a rank's heartbeats (default 10; 0: none)
    LASTGOOD_JOIN_SECONDS     how long a rank that created a Checkpointer waits for every other
                              rank to create theirs before it raises (default 30; distributed.arrive)
    LASTGOOD_DEBUG            1: the command line prints a traceback on an unexpected error
    LASTGOOD_FILE_BYTES       a rank's state of at least twice this size is split into files of
                              this size or more on average (at most 4), written and read in parallel
                              (default 256M, and then at most one file per CPU this rank has on its
                              host; set: at most 4 whatever the host; 0: one file per rank; K/M/G
                              accepted; state/split.py)
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from lastgood.common.sizes import parse_size
from lastgood.remote.retry import RetryPolicy

# the service a client talks to when neither an argument nor LASTGOOD_URL names one
DEFAULT_URL = "http://127.0.0.1:8000"
ENV_URL = "LASTGOOD_URL"
ENV_TOKEN = "LASTGOOD_TOKEN"
ENV_RUN = "LASTGOOD_RUN"
ENV_ATTEMPT = "LASTGOOD_ATTEMPT"
ENV_NEW_RUN = "LASTGOOD_NEW_RUN"
ENV_SPOOL = "LASTGOOD_USE_SPOOL"
ENV_SPOOL_DEPRECATED = "LASTGOOD_SPOOL"  # the service's switch (offer a spool), once read here too
ENV_DEDUP = "LASTGOOD_DEDUP"
ENV_DDP_BUCKETS = "LASTGOOD_DDP_BUCKETS"
ENV_DIRECT_FS_MOUNT = "LASTGOOD_DIRECT_FS_MOUNT"
ENV_RETRY_DEADLINE = "LASTGOOD_RETRY_DEADLINE"
ENV_RETRY_INITIAL = "LASTGOOD_RETRY_INITIAL"
ENV_RETRY_MAX_DELAY = "LASTGOOD_RETRY_MAX_DELAY"
ENV_DEBUG = "LASTGOOD_DEBUG"
ENV_HEARTBEAT = "LASTGOOD_HEARTBEAT_SECONDS"
ENV_SUPERVISOR_LAUNCH = "LASTGOOD_SUPERVISOR_LAUNCH"  # `lastgood supervise` marks each launch's processes
DEFAULT_HEARTBEAT = 10.0
ENV_JOIN = "LASTGOOD_JOIN_SECONDS"
DEFAULT_JOIN = 30.0
ENV_FILE_BYTES = "LASTGOOD_FILE_BYTES"
ENV_AGENT = "LASTGOOD_AGENT"  # HOST:PORT of the node agent of the memory tier (`lastgood supervise --memory-budget` sets it)
# a state of 512 MiB or more is written as 2-4 files at once: one writer thread cannot fill
# the page cache as fast as several (docs/performance.md, "Parallel files per rank")
DEFAULT_FILE_BYTES = 256 << 20

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class ClientConfig:
    url: str | None = None          # None: the caller says what is missing (Checkpointer, DCP)
    token: str | None = field(default=None, repr=False)
    run: str | None = None          # None: torchrun's --rdzv-id may name it (distributed.run_name)
    attempt: str | None = None      # None: drawn per launch (distributed.launch_attempt)
    new_run: bool = False
    spool: bool = True
    dedup: bool = True              # replicated (DDP) state written once per checkpoint (replicas.py)
    ddp_buckets: bool = True        # DDP resumes in its saved gradient-bucket layout (ddp_buckets.py)
    direct_fs_mount: str | None = None  # None: no direct-FS writes (directfs.py)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    heartbeat_seconds: float = DEFAULT_HEARTBEAT
    file_bytes: int = DEFAULT_FILE_BYTES  # 0: one file per rank (state/split.py)
    files_by_cores: bool = True     # file_bytes is the default: at most a file per core (split.files_per_rank)
    join_seconds: float = DEFAULT_JOIN  # every rank creates its Checkpointer within this (distributed.arrive)

    @classmethod
    def resolve(cls, *, url: str | None = None, token: str | None = None, run: str | None = None,
                attempt: str | None = None, new_run: bool | None = None, spool: bool | None = None,
                retry: RetryPolicy | None = None, heartbeat_seconds: float | None = None,
                dedup: bool | None = None, direct_fs_mount: str | None = None, file_bytes: int | None = None,
                env: Mapping[str, str] | None = None) -> "ClientConfig":
        """Each setting from its argument when given (not None; an empty string counts as
        not given for the strings), else from the environment (`env`, default os.environ),
        else its default. A malformed retry setting is a ValueError naming the variable."""
        env = os.environ if env is None else env
        return cls(url=url or env.get(ENV_URL) or None, token=token or env.get(ENV_TOKEN) or None,
                   run=run or env.get(ENV_RUN) or None, attempt=attempt or env.get(ENV_ATTEMPT) or None,
                   new_run=_flag(env, ENV_NEW_RUN, False) if new_run is None else new_run,
                   spool=_spool_flag(env) if spool is None else spool,
                   dedup=_flag(env, ENV_DEDUP, True) if dedup is None else dedup,
                   ddp_buckets=_flag(env, ENV_DDP_BUCKETS, True),
                   direct_fs_mount=direct_fs_mount or env.get(ENV_DIRECT_FS_MOUNT) or None,
                   retry=retry or retry_policy(env),
                   heartbeat_seconds=heartbeat_period(env) if heartbeat_seconds is None else heartbeat_seconds,
                   file_bytes=byte_count(env, ENV_FILE_BYTES, DEFAULT_FILE_BYTES) if file_bytes is None else file_bytes,
                   files_by_cores=file_bytes is None and not env.get(ENV_FILE_BYTES, "").strip(),
                   join_seconds=_seconds(env, ENV_JOIN, DEFAULT_JOIN))


def retry_policy(env: Mapping[str, str] | None = None, **overrides) -> RetryPolicy:
    """The default RetryPolicy, then the LASTGOOD_RETRY_* environment, then `overrides`
    that are not None."""
    env = os.environ if env is None else env
    base = RetryPolicy(deadline=_seconds(env, ENV_RETRY_DEADLINE, RetryPolicy.deadline),
                       initial=_seconds(env, ENV_RETRY_INITIAL, RetryPolicy.initial),
                       max_delay=_seconds(env, ENV_RETRY_MAX_DELAY, RetryPolicy.max_delay))
    return base.with_(**overrides)


def heartbeat_period(env: Mapping[str, str] | None = None) -> float:
    """Seconds between a rank's heartbeats: LASTGOOD_HEARTBEAT_SECONDS (default 10; 0: no
    beats; else 0.05..3600). docs/health.md."""
    value = _seconds(os.environ if env is None else env, ENV_HEARTBEAT, DEFAULT_HEARTBEAT)
    if not (value == 0 or 0.05 <= value <= 3600):
        raise ValueError(f"{ENV_HEARTBEAT} must be 0 (off) or 0.05..3600 seconds, got {value!r}")
    return value


def debug(env: Mapping[str, str] | None = None) -> bool:
    """LASTGOOD_DEBUG set to anything but a false word (0, false, no, off)."""
    raw = (os.environ if env is None else env).get(ENV_DEBUG, "").strip().lower()
    return bool(raw) and raw not in _FALSE


def _spool_flag(env: Mapping[str, str]) -> bool:
    """LASTGOOD_USE_SPOOL; where only the old LASTGOOD_SPOOL is set (the service's switch,
    which scripts set for trainers too), that one, with a warning to rename it."""
    if env.get(ENV_SPOOL, "").strip() or not env.get(ENV_SPOOL_DEPRECATED, "").strip():
        return _flag(env, ENV_SPOOL, True)
    warnings.warn(f"{ENV_SPOOL_DEPRECATED} on a trainer is deprecated: it is the service's switch; set "
                  f"{ENV_SPOOL} on the trainer instead", FutureWarning, stacklevel=4)
    return _flag(env, ENV_SPOOL_DEPRECATED, True)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    return default


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {raw!r}")
    return value


def byte_count(env: Mapping[str, str], name: str, default: int) -> int:
    """A byte count (common/sizes.py: 268435456, 256M, 1G); 0 allowed."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse_size(raw)
    except ValueError as e:
        raise ValueError(f"{name} must be a byte count such as 268435456, 256M or 1G: {e}") from None
