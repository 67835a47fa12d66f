"""The `lastgood` command group: global options, output, exit codes, error handling.

Every command talks to the service over REST only (lastgood.remote.rest.RestClient, which
opens no gRPC channel) and never imports torch, so the command line works from a plain
`pip install lastgood` on a laptop or a login node.

Output contract: with `--json` a command prints exactly one JSON document on stdout (the
service's answer, or for `download` a summary) and nothing else there; without it, text
for people. Errors are one line on stderr, `lastgood: error: ...`, and an exit code a
script can branch on (Exit below; `lastgood --help` lists them).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import click
from rich.console import Console

from lastgood import __version__, errors
from lastgood.remote import config, reading
from lastgood.remote.config import DEFAULT_URL
from lastgood.remote.reading import CkptRef, parse_ckpt
from lastgood.wire import names
from lastgood.errors import CorruptCheckpoint, ServiceError

# lastgood.remote.rest (and with it the manifest schema) is imported when a command first talks to
# the service, not for --help or a usage error.

if TYPE_CHECKING:
    from lastgood.remote.rest import RestClient



class Exit(IntEnum):
    OK = 0
    ERROR = 1          # anything unexpected, a service-side 5xx included
    USAGE = 2          # click's own: bad option, missing argument, malformed value
    NOT_FOUND = 3      # HTTP 404: no such run, checkpoint, tag, lease
    REFUSED = 4        # HTTP 400/401/403/409/413/416/422: the service refused the request
    VERIFICATION = 5   # a hash mismatch or a truncated file: the bytes are not what was committed
    UNREACHABLE = 6    # no answer: refused, DNS, timeout, 502/503/504
    GAVE_UP = 7        # supervise: restarts exhausted (or no rank left), the job did not finish
    INTERRUPTED = 130  # Ctrl-C; supervise: stopped by a signal, the job ended cleanly


EXIT_HELP = """\b
Exit codes:
    0  ok
    1  unexpected error
    2  usage error (bad option or argument)
    3  not found (no such run, checkpoint or tag)
    4  conflict or refused (the service said no: 400, 401, 403, 409, 422)
    5  verification failed (hash mismatch, truncated or corrupt data)
    6  service unreachable (connection refused, timeout)
    7  supervise: gave up (restarts exhausted), the job did not finish
  130  interrupted (Ctrl-C); supervise: stopped by SIGINT, SIGTERM or SIGHUP
"""


class CliError(Exception):
    """An error the command line reports as one line, with its own exit code."""

    def __init__(self, message: str, exit_code: Exit = Exit.ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# the error classes (lastgood.errors) -> exit codes, the first that matches
EXIT_FOR: tuple[tuple[type[ServiceError], Exit], ...] = (
    (errors.DataLoss, Exit.VERIFICATION),        # the service found its own bytes corrupt
    (errors.NotFound, Exit.NOT_FOUND),
    (errors.Refused, Exit.REFUSED),
    (errors.Internal, Exit.ERROR),               # failed inside the service: unexpected
    (errors.Unavailable, Exit.UNREACHABLE),      # no answer, 502/503/504
    (errors.CatalogBehind, Exit.UNREACHABLE),    # a 503 until an operator runs `rebuild`
)


def exit_code_for(exc: BaseException) -> Exit:
    if isinstance(exc, CliError):
        return exc.exit_code
    if isinstance(exc, CorruptCheckpoint):  # bytes that are not what was committed (remote/reading.py)
        return Exit.VERIFICATION
    if isinstance(exc, ServiceError):
        return next((code for cls, code in EXIT_FOR if isinstance(exc, cls)), Exit.ERROR)
    return Exit.ERROR


def error_message(exc: BaseException) -> str:
    """The service's own message where there is one (not the method and path)."""
    if isinstance(exc, ServiceError) and exc.status is not None:
        if exc.status >= 500:
            return f"the service failed (HTTP {exc.status}): {exc.detail}"
        if exc.no_route:  # no route matched: not a lastgood endpoint, or an old service
            return f"{exc} (is --url a lastgood service of this version?)"
        if isinstance(exc, errors.Unauthenticated):
            return f"{exc.detail} (give one with --token or {config.ENV_TOKEN})"
        return exc.detail
    if isinstance(exc, json.JSONDecodeError):
        return f"the service's answer is not JSON ({exc}): is --url a lastgood service?"
    text = str(exc) or type(exc).__name__
    if isinstance(exc, (CliError, ServiceError, CorruptCheckpoint, OSError)):
        return text
    return f"unexpected {type(exc).__name__}: {text}"


def one_line(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------- state shared by the commands
def make_console(stderr: bool) -> Console:
    """No markup guessing (highlight, emoji) on what we print. Into a pipe or a file, rich
    would assume 80 columns and fold hashes and names; use a wide line there instead
    (COLUMNS still wins)."""
    stream = sys.stderr if stderr else sys.stdout
    wide = None if "COLUMNS" in os.environ or stream.isatty() else 200
    return Console(stderr=stderr, highlight=False, emoji=False, width=wide)


@dataclass
class State:
    url: str
    timeout: float
    token: str | None = field(default=None, repr=False)
    json: bool = False
    _rest: "RestClient | None" = field(default=None, repr=False)
    out: Console = field(default_factory=lambda: make_console(stderr=False))
    err: Console = field(default_factory=lambda: make_console(stderr=True))

    @property
    def rest(self) -> "RestClient":
        if self._rest is None:
            from lastgood.remote.rest import RestClient

            self._rest = RestClient(self.url, self.timeout, self.token)
        return self._rest

    def emit(self, document, human: Callable[[Console], None]) -> None:
        """--json: the document on stdout; else the human rendering."""
        if self.json:
            click.echo(json.dumps(document, indent=2, ensure_ascii=False))
        else:
            human(self.out)

    # ---- checkpoint references: `42`, `RUN@last-good`, `RUN@TAG` (remote/reading.py)
    def resolve(self, ref: CkptRef) -> int:
        return reading.resolve(self.rest, ref)


pass_state = click.make_pass_decorator(State)


# ---------------------------------------------------------------- parameter types
class CkptType(click.ParamType):
    """A checkpoint on the command line (parse_ckpt)."""

    name = "CKPT"

    def convert(self, value, param, ctx):
        if isinstance(value, CkptRef):
            return value
        try:
            return parse_ckpt(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


class CkptOrRunType(CkptType):
    """A checkpoint (an id, RUN@TAG) or a whole run (a bare run name): `lastgood show`."""

    name = "CKPT|RUN"

    def convert(self, value, param, ctx):
        text = str(value)
        if isinstance(value, CkptRef) or "@" in text or text.isdigit():
            return super().convert(value, param, ctx)
        try:
            return CkptRef(run=names.check_run_name(text))
        except names.InvalidName as e:
            self.fail(f"{text!r} is not a checkpoint id, RUN@TAG or a run name: {e}", param, ctx)


class RunType(click.ParamType):
    name = "RUN"

    def convert(self, value, param, ctx):
        try:
            return names.check_run_name(value)
        except names.InvalidName as e:
            self.fail(str(e), param, ctx)


class UrlType(click.ParamType):
    """The service's REST base URL: http(s)://HOST[:PORT][/PREFIX]. Without a scheme urllib
    would fail later with "unknown url type", reported as an unreachable service (exit 6);
    it is a usage error, said up front."""

    name = "URL"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        parts = urllib.parse.urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            hint = f" (did you mean http://{text}?)" if "://" not in text else ""
            self.fail(f"{text!r} is not an http:// or https:// URL{hint}", param, ctx)
        return text


CKPT = CkptType()
CKPT_OR_RUN = CkptOrRunType()
RUN = RunType()
URL = UrlType()


def json_option(f):
    """`--json` after the command too (`lastgood ls RUN --json`), same as before it."""
    def set_json(ctx: click.Context, _param, value: bool) -> None:
        if value:
            ctx.find_object(State).json = True

    return click.option("--json", "json_", is_flag=True, expose_value=False, callback=set_json,
                        help="Print the result as JSON on stdout.")(f)


# ---------------------------------------------------------------- the group
class LastgoodGroup(click.Group):
    """Turns every error a command raises into one stderr line and its exit code."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)  # the order they are defined in: reads, curation, gc, transfer

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("lastgood: interrupted", err=True)
            ctx.exit(Exit.INTERRUPTED)
        except BrokenPipeError:  # `lastgood ls RUN | head`: the reader left; say nothing
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            ctx.exit(Exit.ERROR)
        except Exception as exc:  # noqa: BLE001 - every error ends here, reported once
            code = exit_code_for(exc)
            click.echo(f"lastgood: error: {one_line(error_message(exc))}", err=True)
            if code == Exit.ERROR and config.debug():
                traceback.print_exc()
            ctx.exit(code)


@click.group(cls=LastgoodGroup, epilog=EXIT_HELP,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--url", envvar=config.ENV_URL, default=DEFAULT_URL, show_default=True, type=URL,
              help=f"REST base URL of the lastgood service [env: {config.ENV_URL}].")
@click.option("--token", envvar=config.ENV_TOKEN, metavar="TOKEN", show_envvar=False,
              help=f"Bearer token, for a service that requires one [env: {config.ENV_TOKEN}].")
@click.option("--json", "json_", is_flag=True, help="Machine-readable output: one JSON document on stdout.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              metavar="SECONDS", help="Give up on a request the service has not answered in this long.")
@click.version_option(__version__, "--version", prog_name="lastgood")
@click.pass_context
def cli(ctx: click.Context, url: str, token: str | None, json_: bool, timeout: float) -> None:
    """Inspect, curate, fetch and export the checkpoints of a lastgood service.

    CKPT is a checkpoint id (42) or RUN@TAG: RUN@last-good, or a tag or alias of the run
    (gpt-small@best). Set LASTGOOD_DEBUG=1 for a traceback on an unexpected error.
    """
    ctx.obj = State(url=url, timeout=timeout, token=token or None, json=json_)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`lastgood`)."""
    cli.main(args=argv, prog_name="lastgood")
