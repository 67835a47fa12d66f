"""`lastgood agent --host LABEL ...`: the memory tier's node agent (lastgood.agent)."""

from __future__ import annotations

import json
import signal
import threading

import click

from lastgood.common.sizes import parse_size
from lastgood.wire import tiers
from lastgood.cli.app import State, cli, pass_state


def size_param(_ctx, _param, value):
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _peers(_ctx, _param, values):
    out = {}
    for v in values:
        host, sep, address = v.partition("=")
        if not sep or ":" not in address:
            raise click.BadParameter(f"{v!r}: HOST=ADDRESS:PORT expected")
        try:
            out[tiers.check_label("host", host)] = address
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return out


@cli.command()
@click.option("--host", "host", required=True, metavar="LABEL", help="This node's host label (partners are on other hosts).")
@click.option("--rack", default="", metavar="LABEL", help="This node's rack label (partners in another rack are preferred).")
@click.option("--switch", default="", metavar="LABEL", help="This node's switch label.")
@click.option("--listen", default="127.0.0.1:0", show_default=True, metavar="ADDR:PORT",
              help="Where the agent serves ranks and partner agents (port 0: any free port).")
@click.option("--advertise", default=None, metavar="ADDR:PORT", help="The address partners reach it at [default: --listen].")
@click.option("--shm-root", default=tiers.SHM_ROOT, show_default=True, type=click.Path(file_okay=False),
              help="Where the segments live (a tmpfs: /dev/shm).")
@click.option("--memory-budget", callback=size_param, default=None, metavar="SIZE",
              help="The most bytes this node's segments may hold (e.g. 64G) [default: no limit].")
@click.option("--replication-rate", callback=size_param, default=None, metavar="SIZE",
              help="Bytes per second replication may send at most (its share of the link, e.g. 500M) [default: no limit].")
@click.option("--peer", "peers", multiple=True, callback=_peers, metavar="HOST=ADDR:PORT",
              help="A fixed placement instead of the service's agent list (repeat per partner); "
                   "implies --standalone.")
@click.option("--standalone", is_flag=True,
              help="Talk to no service: no registration, no copy reports, no freeing by the live list "
                   "(memory checkpoints cannot commit; for tests of the agents' own protocol).")
@click.option("--live-every", type=click.FloatRange(0.1), default=5.0, show_default=True, metavar="SECONDS",
              help="Ask the service this often which checkpoints are live; free the rest.")
@click.option("--fresh", is_flag=True,
              help="Remove what an earlier agent left under --shm-root instead of adopting it (by default "
                   "a restarted agent hashes those segments, holds and reports them again).")
@pass_state
def agent(st: State, host: str, rack: str, switch: str, listen: str, advertise: str | None, shm_root: str,
          memory_budget: int | None, replication_rate: int | None, peers: dict[str, str], standalone: bool,
          live_every: float, fresh: bool) -> None:
    """Run the node agent of the memory tier until SIGTERM/SIGINT.

    \b
        lastgood agent --host node-a --memory-budget 64G --replication-rate 1G

    Prints one JSON line when it serves: {"address", "agent_id"}.
    """
    node = start_agent(st, host=host, rack=rack, switch=switch, listen=listen, advertise=advertise,
                       shm_root=shm_root, memory_budget=memory_budget, replication_rate=replication_rate,
                       peers=peers, standalone=standalone, live_every=live_every, adopt=not fresh)
    click.echo(json.dumps({"address": node.address,
                           "agent_id": node.service.agent_id if node.service else None}), nl=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    node.stop()


def start_agent(st: State, *, host: str, listen: str, shm_root: str, memory_budget: int | None,
                replication_rate: int | None, rack: str = "", switch: str = "", advertise: str | None = None,
                peers: dict[str, str] | None = None, standalone: bool = False, live_every: float = 5.0,
                adopt: bool = True):
    """A started node agent (lastgood.agent.server.Agent), for `agent` and `supervise --memory-budget`."""
    from lastgood.agent.segments import Segments
    from lastgood.agent.server import Agent
    from lastgood.agent.service import ServiceLink
    from lastgood.remote.rest import RestClient
    from lastgood.remote.retry import NO_RETRY

    addr, _, port = listen.rpartition(":")
    if not addr or not port.isdigit():
        raise click.BadParameter(f"{listen!r}: ADDR:PORT expected", param_hint="--listen")
    try:
        link = None
        if not (peers or standalone):
            link = ServiceLink(RestClient(st.url, st.timeout, st.token, retry=NO_RETRY), host, rack, switch, "")
        node = Agent(Segments(shm_root, memory_budget), host, rack=rack, switch=switch, bind=(addr, int(port)),
                     advertise=advertise, service=link, peers=peers, rate=replication_rate, live_every=live_every,
                     adopt=adopt)
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from None
    node.start()
    return node
