"""The agent's calls to the service (docs/memory-tier.md, the wire contract): registration,
placement, copy reports, the live list. Every failure is returned as an event, never raised
into the agent's loops: with the service down memory checkpoints cannot commit, and the agent
keeps what it holds."""

from __future__ import annotations

from lastgood.errors import LastgoodError
from lastgood.remote.rest import RestClient
from lastgood.wire import tiers


class ServiceLink:
    def __init__(self, rest: RestClient, host: str, rack: str, switch: str, address: str) -> None:
        self.rest, self.host, self.rack, self.switch, self.address = rest, host, rack, switch, address
        self.agent_id: int | None = None
        self.key: str | None = None

    def register(self) -> None:
        got = self.rest.register_agent({"host": self.host, "rack": self.rack, "switch": self.switch,
                                        "address": self.address})
        self.agent_id, self.key = int(got["agent_id"]), str(got["key"])

    def place(self) -> tiers.AgentPlace:
        return tiers.AgentPlace(self.rack, self.switch, self.host, self.agent_id or 0)

    def agents(self) -> dict[tiers.AgentPlace, str]:
        got = self.rest.agents()
        return {tiers.AgentPlace(a.get("rack", ""), a.get("switch", ""), a["host"], int(a["agent_id"])): a["address"]
                for a in got["agents"]}

    def report(self, checkpoint_id: int, rank: int, files: list[dict]) -> dict:
        return self.rest.report_copies(checkpoint_id, {"agent_id": self.agent_id, "rank": rank, "files": files},
                                       self.key)

    def live(self) -> set[tuple[str, int]]:
        got = self.rest.agent_live(self.agent_id, self.key)
        return {(x["run"], int(x["checkpoint_id"])) for x in got["live"]}


SERVICE_ERRORS = (LastgoodError, KeyError, TypeError, ValueError)
