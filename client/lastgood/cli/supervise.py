"""`lastgood supervise [OPTIONS] -- torchrun ... train.py ...` (the policy is in lastgood.supervise.supervisor)."""

from __future__ import annotations

import os
import socket

import click

from lastgood.wire import names, tiers
from lastgood.remote.config import ENV_AGENT, ENV_RUN
from lastgood.supervise.supervisor import Outcome, Policy, Supervisor, UsageError, run_of
from lastgood.cli.agent import size_param, start_agent
from lastgood.cli.app import RUN, Exit, State, cli, pass_state

EXIT = {Outcome.FINISHED: Exit.OK, Outcome.GAVE_UP: Exit.GAVE_UP, Outcome.STOPPED: Exit.INTERRUPTED}


def _ranks(_ctx, _param, value: str | None) -> set[int]:
    if not value:
        return set()
    try:
        ranks = {int(v) for v in value.split(",") if v.strip()}
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of local ranks (e.g. 3 or 2,3)") from None
    if any(r < 0 for r in ranks):
        raise click.BadParameter("local ranks are >= 0")
    return ranks


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--max-restarts", type=click.IntRange(0), default=3, show_default=True,
              help="Relaunch at most this many times; then give up (exit 7).")
@click.option("--hang-timeout", type=click.FloatRange(0, min_open=True), default=None, metavar="SECONDS",
              help="A rank whose step has not advanced for this long is hung [default: the service's, "
                   "computed from the run's step times].")
@click.option("--drain", callback=_ranks, metavar="RANKS",
              help="Leave these local ranks out from the start (comma-separated): the job runs with "
                   "fewer processes per node.")
@click.option("--drain-after", type=click.IntRange(1), default=2, show_default=True,
              help="Leave out a local rank once it has been to blame for this many failures.")
@click.option("--poll", type=click.FloatRange(0.1), default=5.0, show_default=True, metavar="SECONDS",
              help="Ask the service for the run's health this often.")
@click.option("--grace", type=click.FloatRange(0), default=10.0, show_default=True, metavar="SECONDS",
              help="Between SIGTERM and SIGKILL when a launch is ended.")
@click.option("--run", "run", type=RUN, default=None,
              help=f"The run the job saves to [default: {ENV_RUN}, else torchrun's --rdzv-id]; passed to "
                   f"the job as {ENV_RUN}.")
@click.option("--memory-budget", callback=size_param, default=None, metavar="SIZE",
              help=f"Run the memory tier's node agent beside the job with this budget (e.g. 64G); the job "
                   f"finds it through {ENV_AGENT} (see `lastgood agent`).")
@click.option("--agent-host", default=None, metavar="LABEL", help="The agent's host label [default: this host's name].")
@click.option("--agent-listen", default="127.0.0.1:0", show_default=True, metavar="ADDR:PORT",
              help="Where the agent serves (an address partner nodes reach, on a multi-node job).")
@click.option("--agent-shm-root", default=tiers.SHM_ROOT, show_default=True, type=click.Path(file_okay=False),
              help="Where the agent's segments live (a tmpfs).")
@click.option("--replication-rate", callback=size_param, default=None, metavar="SIZE",
              help="Bytes per second the agent's replication may send [default: no limit].")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_state
def supervise(st: State, max_restarts: int, hang_timeout: float | None, drain: set[int], drain_after: int,
              poll: float, grace: float, run: str | None, memory_budget: int | None, agent_host: str | None,
              agent_listen: str, agent_shm_root: str, replication_rate: int | None, command: tuple[str, ...]) -> None:
    """Run COMMAND, relaunch it when a rank hangs or the job fails.

    \b
        lastgood supervise --max-restarts 5 -- torchrun --nproc-per-node=8 train.py

    Every poll it asks the service for the run's health; a hung rank, or the command
    exiting with an error, ends every process of the launch (SIGTERM, then SIGKILL) and
    relaunches it with a new LASTGOOD_ATTEMPT: the job resumes from last-good. A local
    rank that keeps failing is drained: the relaunch runs one process per node fewer.
    The service being unreachable never stops the job. Exit: 0 the job finished, 7 gave
    up, 130 stopped by SIGINT/SIGTERM/SIGHUP (the job was ended first).
    """
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    name = run or os.environ.get(ENV_RUN) or run_of(cmd)
    if not name:
        raise click.UsageError(f"name the run: --run NAME, {ENV_RUN}, or torchrun --rdzv-id=NAME")
    try:
        names.check_run_name(name)
        policy = Policy(max_restarts=max_restarts, hang_timeout=hang_timeout, poll=poll, grace=grace,
                        drain_after=drain_after)
        sup = Supervisor(cmd, name, _rest(st, poll), policy, drain)
    except (UsageError, names.InvalidName) as e:
        raise click.UsageError(str(e)) from None
    node = None
    if memory_budget is not None:
        host = agent_host or socket.gethostname().split(".")[0]
        try:
            tiers.check_label("--agent-host", host)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        node = start_agent(st, host=host, listen=agent_listen, shm_root=agent_shm_root,
                           memory_budget=memory_budget, replication_rate=replication_rate)
        os.environ[ENV_AGENT] = node.address   # the job's processes inherit it
    try:
        outcome = sup.supervise()
    except UsageError as e:  # the command could not be started
        raise click.UsageError(str(e)) from None
    finally:
        if node is not None:
            node.stop()
    click.get_current_context().exit(EXIT[outcome])


def _rest(st: State, poll: float):
    """One try per call, answered within the poll: the supervisor asks again next poll
    rather than retrying (and never waits long on a service that is away)."""
    from lastgood.remote.rest import RestClient

    return RestClient(st.url, min(st.timeout, max(2.0, poll)), st.token)
