"""Human renderings of the service's answers.

Every string that comes from a user or the service (run names, tags, file names, event
data, messages) goes into a rich `Text`, never into a markup string: a tag named
"[red]x[/red]" or ":smile:" prints exactly as it was written.
"""

from __future__ import annotations

import json

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from lastgood.cli import lineage
from lastgood.wire import names
from lastgood.wire.vocab import Status

STATUS_STYLE = {Status.COMMITTED: "green", Status.PENDING: "yellow", Status.ABANDONED: "dim", Status.CORRUPT: "bold red",
                Status.DELETED: "dim strike"}
TAG_STYLE = {"tag": "cyan", "alias": "bold cyan", "pin": "magenta", "system": "yellow"}
LAST_GOOD = "← last-good"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def fmt_time(iso: str | None) -> str:
    if not iso:
        return "-"
    return iso.replace("T", " ")[:19]


def status_text(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


def tags_text(tags: list[dict], skip_last_good: bool = False) -> Text:
    out = Text()
    for t in tags:
        if skip_last_good and t["name"] == names.LAST_GOOD_TAG and t["kind"] == "system":
            continue
        if out:
            out.append("  ")
        style = "bold red" if t["name"] == "suspect" and t["kind"] == "system" else TAG_STYLE.get(t["kind"], "")
        out.append(t["name"], style=style)
        if t["kind"] == "alias":
            out.append(" (alias)", style="dim")
    return out


def ckpt_id(cid: int | None, style: str = "bold") -> Text:
    return Text("-" if cid is None else f"#{cid}", style=style if cid is not None else "dim")


HASH_COLUMNS = {"XXH3-128", "EXPECTED", "FOUND"}


def make_table(*columns: str, **kw) -> Table:
    """Columns fold rather than cut, so nothing printed is ever hidden; hashes never fold."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, **kw)
    for c in columns:
        if c in HASH_COLUMNS:
            table.add_column(c, no_wrap=True, min_width=32)
        else:
            table.add_column(c, overflow="fold")
    return table


def page_footer(console: Console, page: dict, what: str) -> None:
    shown, total, offset = len(page["items"]), page["total"], page["offset"]
    if shown < total:
        first = offset + 1 if shown else offset
        console.print(Text(f"{what} {first}-{offset + shown} of {total}; "
                           f"more with --offset {offset + shown}", style="dim"))


# ---------------------------------------------------------------- runs, checkpoints
def runs(console: Console, page: dict) -> None:
    if not page["items"]:
        console.print(Text("no runs yet" if page["total"] == 0 else "no runs on this page", style="dim"))
        return
    table = make_table("RUN", "LAST-GOOD", "STEP", "CHECKPOINTS", "CREATED")
    table.columns[2].justify = "right"
    for r in page["items"]:
        lg = r["last_good"]
        counts = ", ".join(f"{n} {s.lower()}" for s, n in r["checkpoints"].items() if n)
        table.add_row(Text(r["name"]), ckpt_id(lg["id"] if lg else None, "bold green"),
                      Text(str(lg["step"]) if lg else "-"), Text(counts or "none"), Text(fmt_time(r["created_at"])))
    console.print(table)
    page_footer(console, page, "runs")


def checkpoints(console: Console, run: str, page: dict) -> None:
    if not page["items"]:
        console.print(Text(f"run {run} has no checkpoints" + (" on this page" if page["total"] else ""),
                           style="dim"))
        return
    table = make_table("ID", "STEP", "STATUS", "SIZE", "TAGS", "COMMITTED")
    for i in (0, 1, 3):
        table.columns[i].justify = "right"
    for c in page["items"]:
        tags = tags_text(c["tags"], skip_last_good=True)
        if c["last_good"]:
            tags = Text.assemble(Text(LAST_GOOD, style="bold green"), "  " if tags else "", tags)
        table.add_row(ckpt_id(c["id"], "bold green" if c["last_good"] else "bold"), Text(str(c["step"])),
                      status_text(c["status"]), Text(fmt_bytes(c["bytes"])), tags,
                      Text(fmt_time(c["committed_at"])))
    console.print(table)
    page_footer(console, page, "checkpoints")


def checkpoint(console: Console, c: dict) -> None:
    head = Text.assemble(ckpt_id(c["id"]), "  run ", Text(c["run"], style="bold"), f"  step {c['step']}  ",
                         status_text(c["status"]))
    if c["last_good"]:
        head.append("  " + LAST_GOOD, style="bold green")
    console.print(head)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column(overflow="fold")
    size = "-" if c["bytes"] is None else f"{fmt_bytes(c['bytes'])} ({c['bytes']:,} bytes)"
    rows = [("attempt", Text(c["attempt"])), ("world size", Text(str(c["world_size"]))),
            ("parent", ckpt_id(c["parent_id"], "")), ("size", Text(size)),
            ("created", Text(fmt_time(c["created_at"]))), ("committed", Text(fmt_time(c["committed_at"])))]
    if c.get("lease_expires_at"):
        rows.append(("lease until", Text(fmt_time(c["lease_expires_at"]))))
    rows.append(("tags", tags_text(c["tags"]) or Text("none", style="dim")))
    for k, v in rows:
        grid.add_row(k, v)
    console.print(grid)
    m = c.get("manifest")
    if not m:
        console.print(Text(f"no manifest: the checkpoint is {c['status']}", style="dim"))
        return
    table = make_table("RANK", "FILE", "SIZE", "XXH3-128", "TENSORS", title="files", title_justify="left")
    table.columns[0].justify = table.columns[2].justify = table.columns[4].justify = "right"
    for r in m["ranks"]:
        for f in r["files"]:
            n = len(f["tensors"]) if f.get("tensors") is not None else None
            table.add_row(Text(str(r["rank"])), Text(f["name"]), Text(fmt_bytes(f["size"])), Text(f["xxh3_128"]),
                          Text("-" if n is None else str(n)))
    console.print(table)


# ---------------------------------------------------------------- a run and its health
STATE_STYLE = {"ok": "green", "hung": "bold red", "lost": "red", "straggler": "yellow"}
MAX_RANK_ROWS = 64  # a big job lists its unhealthy ranks and this many others


def fmt_seconds(s: float | None) -> str:
    """3.2 s, 14 min, 2.5 h, 3.1 d."""
    if s is None:
        return "-"
    for limit, unit, div in ((120, "s", 1), (7200, "min", 60), (3 * 86400, "h", 3600)):
        if s < limit:
            return f"{s / div:.1f} {unit}" if s / div < 10 else f"{s / div:.0f} {unit}"
    return f"{s / 86400:.1f} d"


def interval_lines(iv: dict) -> list[tuple[str, Text]]:
    """The auto interval and the numbers it comes from, as label/value rows."""
    m = Text(fmt_seconds(iv["mtbf_s"]))
    note = ("the prior: no failure yet" if iv["mtbf_source"] == "prior"
            else f"{iv['failures']} failure(s) in {fmt_seconds(iv['exposure_s'])}")
    m.append(f"  ({note})", style="dim")
    rows = [("checkpoint cost C", Text(fmt_seconds(iv["cost_s"]) if iv["cost_s"] else "not measured yet (no save)")),
            ("time between failures M", m)]
    if iv["seconds"] is not None:
        tau = Text(fmt_seconds(iv["seconds"]), style="bold")
        if iv.get("steps"):
            tau.append(f"  (about {iv['steps']:,} steps)", style="dim")
        tau.append(f"  Young √(2·C·M) = {fmt_seconds(iv['young_s'])}", style="dim")
        rows += [("auto interval τ (Daly)", tau),
                 ("work lost per failure", Text(f"{fmt_seconds(iv['expected_loss_s'])}  ((τ + C) / 2)"))]
    return rows


def failures_text(f: dict) -> Text:
    """The run's recent failure events, as the page's badge counts them: "2 in 24 h (save_given_up 2)"."""
    window = fmt_seconds(f["window_s"])
    if not f["count"]:
        return Text(f"none in {window}", style="green")
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(f["kinds"].items()))
    return Text.assemble(Text(f"{f['count']} in {window}", style="bold red"),
                         Text(f"  ({kinds}; last {fmt_time(f['last_at'])})", style="dim"))


def run(console: Console, r: dict, h: dict) -> None:
    lg = r.get("last_good")
    head = Text.assemble("run ", Text(r["name"], style="bold"))
    if lg:
        head.append(f"  last-good #{lg['id']} step {lg['step']}", style="bold green")
    console.print(head)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column(overflow="fold")
    bad = {"hung": h["hung"], "stragglers": h["stragglers"], "lost": h.get("lost", [])}
    verdict = Text()
    for k, ranks in bad.items():
        if ranks:
            verdict.append(f"{k} {', '.join(map(str, ranks[:20]))}{' ...' if len(ranks) > 20 else ''}  ",
                           style=STATE_STYLE.get(k.rstrip("s"), "yellow"))
    if not h["ranks"]:
        verdict = Text("no heartbeats yet", style="dim")
    elif h.get("finished"):
        verdict = Text(f"finished {fmt_time(h['finished_at'])} (every rank closed its Checkpointer)", style="bold")
    elif not verdict:
        verdict = Text("every rank ok", style="green")
    rows = [("health", verdict), ("world size", Text(str(h["world_size"] or "-")))]
    if not h.get("finished"):
        rows.append(("hang timeout", Text(fmt_seconds(h["timeout_s"]))))
    if "failures" in h:
        rows.append(("failures", failures_text(h["failures"])))
    for k, v in rows + interval_lines(h["interval"]):
        grid.add_row(k, v)
    console.print(grid)
    if not h["ranks"]:
        return
    shown = [x for x in h["ranks"] if x["state"] != "ok"]
    shown += [x for x in h["ranks"] if x["state"] == "ok"][:max(0, MAX_RANK_ROWS - len(shown))]
    table = make_table("RANK", "STEP", "PHASE", "STEP TIME", "LAST BEAT", "NO PROGRESS", "STATE")
    for x in sorted(shown, key=lambda x: x["rank"]):
        table.add_row(Text(str(x["rank"])), Text("-" if x["step"] is None else str(x["step"])), Text(x["phase"]),
                      Text(fmt_seconds(x.get("typical_step_s") or x["step_seconds"])),
                      Text(fmt_seconds(x["age_s"]) + " ago"), Text(fmt_seconds(x.get("progress_age_s"))),
                      Text(x["state"], style=STATE_STYLE.get(x["state"], "")))
    console.print(table)
    if len(shown) < len(h["ranks"]):
        console.print(Text(f"{len(h['ranks']) - len(shown)} more ranks ok (--json lists every rank)", style="dim"))


# ---------------------------------------------------------------- lineage
def _node_label(n: dict, parent_note: int | None) -> Text:
    lg = n.get("last_good")
    label = Text.assemble(ckpt_id(n["id"], "bold green" if lg else "bold"), f"  step {n['step']}  ",
                          status_text(n["status"]))
    if n.get("bytes") is not None:
        label.append(f"  {fmt_bytes(n['bytes'])}", style="dim")
    tags = tags_text(n["tags"], skip_last_good=True)
    if tags:
        label.append("  ")
        label.append_text(tags)
    if parent_note is not None:
        label.append(f"  (parent #{parent_note})", style="dim")
    if lg:
        label.append("  " + LAST_GOOD, style="bold green reverse")
    return label


def _gap_label(g: lineage.Gap) -> Text:
    a, b = g.nodes[0], g.nodes[-1]
    ids = f"#{a['id']}" if g.count == 1 else f"#{a['id']}..#{b['id']}"
    steps = f"step {a['step']}" if g.count == 1 else f"steps {a['step']}..{b['step']}"
    word = "checkpoint" if g.count == 1 else "checkpoints"
    return Text(f"⋮ {g.count} {word} hidden ({ids}, {steps})", style="dim italic")


def _add_branch(parent: Tree, b: lineage.Branch, view: lineage.View) -> None:
    head = Text(f"branch {b.number}", style="bold blue")
    if b.fork is not None:
        head.append(f" from #{b.fork}", style="blue")
    node_tree = parent.add(head)
    prev_id = b.fork
    for item in b.items:
        if isinstance(item, lineage.Gap):
            node_tree.add(_gap_label(item))
            prev_id = item.nodes[-1]["id"]
            continue
        note = item["parent_id"] if item["parent_id"] is not None and item["parent_id"] != prev_id else None
        sub = node_tree.add(_node_label(item, note))
        prev_id = item["id"]
        for child in view.forks.get(item["id"], ()):
            _add_branch(sub, child, view)


def lineage_tree(console: Console, doc: dict, max_nodes: int) -> None:
    view = lineage.build(doc["nodes"], max_nodes)
    lg = next((n for n in doc["nodes"] if n.get("last_good")), None)
    title = Text.assemble(Text(doc["run"], style="bold"),
                          f"  {doc['total']} checkpoint{'s' if doc['total'] != 1 else ''}, "
                          f"{doc['branches']} branch{'es' if doc['branches'] != 1 else ''}, last-good ",
                          Text(f"#{lg['id']} (step {lg['step']})", style="bold green") if lg else Text("none", style="dim"))
    tree = Tree(title)
    for b in view.roots:
        _add_branch(tree, b, view)
    console.print(tree)
    if view.shown < view.total:
        console.print(Text(f"{view.shown} of {view.total} checkpoints shown; --max-nodes 0 shows all",
                           style="dim"))


# ---------------------------------------------------------------- events, curation, gc, verify
def events(console: Console, run: str, page: dict) -> None:
    if not page["items"]:
        console.print(Text(f"run {run} has no events" + (" on this page" if page["total"] else ""), style="dim"))
        return
    table = make_table("AT", "KIND", "CKPT", "DATA")
    for e in page["items"]:
        data = json.dumps(e["data"], ensure_ascii=False, separators=(", ", ": "), sort_keys=True) if e["data"] else ""
        table.add_row(Text(fmt_time(e["at"])), Text(e["kind"], style="bold"), ckpt_id(e["checkpoint_id"], ""),
                      Text(data))
    console.print(table)
    page_footer(console, page, "events")


def line(console: Console, *parts) -> None:
    console.print(Text.assemble(*parts))


def plan_of_run(plan: dict, run: str) -> dict:
    """One run's part of a GC plan, as the page's "this run only" shows it: its checkpoints
    and their bytes; orphan and unknown blobs belong to no run and are left out."""
    cks = [d for d in plan["checkpoints"] if d["run"] == run]
    return {**plan, "checkpoints": cks, "bytes_freed": sum(d["bytes"] or 0 for d in cks), "orphans": [],
            "unknown": [], "run": run, "all_runs_bytes_freed": plan["bytes_freed"]}


def gc_summary(plan: dict, verb: str) -> str:
    """'<verb> N checkpoints [of run R] [and M orphan blobs], freeing X (B bytes)'."""
    cks, orphans = plan["checkpoints"], plan["orphans"]
    summary = f"{verb} {len(cks)} checkpoint{'s' if len(cks) != 1 else ''}"
    if "run" in plan:
        summary += f" of run {plan['run']}"
    if orphans:
        summary += f" and {len(orphans)} orphan blob{'s' if len(orphans) != 1 else ''}"
    return summary + f", freeing {fmt_bytes(plan['bytes_freed'])} ({plan['bytes_freed']:,} bytes)"


def gc_plan(console: Console, plan: dict, dry_run: bool) -> None:
    verb = "would delete" if dry_run else "deleting"
    cks = plan["checkpoints"]
    line(console, Text("GC plan", style="bold"), "  retention ", Text(plan["policy"], style="cyan"))
    if cks:
        table = make_table("ID", "RUN", "STEP", "STATUS", "SIZE", "REASON")
        for i in (0, 2, 4):
            table.columns[i].justify = "right"
        for d in cks:
            table.add_row(ckpt_id(d["checkpoint_id"]), Text(d["run"]), Text(str(d["step"])),
                          status_text(d["status"]), Text(fmt_bytes(d["bytes"])), Text(d["reason"]))
        console.print(table)
    console.print(Text(gc_summary(plan, verb), style="bold"))
    if "all_runs_bytes_freed" in plan:
        console.print(Text(f"all runs: {fmt_bytes(plan['all_runs_bytes_freed'])} freed", style="dim"))
    if plan["unknown"]:
        console.print(Text(f"{len(plan['unknown'])} blob(s) lastgood cannot place are left alone", style="dim"))


def gc_result(console: Console, result: dict) -> None:
    deleted, skipped = result["deleted"], result["skipped"]
    text = (f"deleted {len(deleted)} checkpoint{'s' if len(deleted) != 1 else ''}"
            + (f" ({', '.join(f'#{i}' for i in deleted)})" if deleted else "")
            + f" and {result['orphans_deleted']} orphan blob(s), freed {fmt_bytes(result['bytes_freed'])}")
    console.print(Text(text, style="bold green" if deleted else "bold"))
    if skipped:
        console.print(Text(f"skipped {', '.join(f'#{i}' for i in skipped)}: kept since the plan was made "
                           f"(a tag, a pin or a read lease)", style="yellow"))


def verify(console: Console, res: dict) -> None:
    cid = res["checkpoint_id"]
    if res["ok"]:
        line(console, ckpt_id(cid), Text("  ok", style="bold green"),
             f": the manifest and {res['files']} file{'s' if res['files'] != 1 else ''} re-hash to their "
             f"committed xxh3-128")
        return
    line(console, ckpt_id(cid), Text(f"  {res['status']}", style="bold red"),
         f": {len(res['bad'])} of {res['files']} file(s) do not match")
    table = make_table("RANK", "FILE", "EXPECTED", "FOUND")
    for b in res["bad"]:
        table.add_row(Text(str(b.get("rank", "-"))), Text(b["file"]), Text(b["expected"] or "-"), Text(b["found"]))
    console.print(table)
