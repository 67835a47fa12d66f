"""The read and curate commands: each is one or two REST calls and a rendering."""

from __future__ import annotations

import sys

import click
from rich.text import Text

from lastgood.cli import render
from lastgood.cli.app import CKPT, CKPT_OR_RUN, RUN, CkptRef, CliError, Exit, State, cli, json_option, pass_state
from lastgood.remote.reading import lineage_all

LIMIT = click.IntRange(1, 1000)
OFFSET = click.IntRange(0)


def paging(default_limit: int = 100):
    def deco(f):
        f = click.option("--offset", type=OFFSET, default=0, show_default=True, help="Skip this many.")(f)
        return click.option("--limit", type=LIMIT, default=default_limit, show_default=True,
                            help="Show at most this many (1-1000).")(f)
    return deco


@cli.command()
@paging()
@json_option
@pass_state
def runs(st: State, limit: int, offset: int) -> None:
    """List runs: last-good and checkpoint counts."""
    page = st.rest.runs(limit, offset)
    st.emit(page, lambda out: render.runs(out, page))


@cli.command("ls")
@click.argument("run", type=RUN)
@click.option("--status", metavar="STATUS", help="Only checkpoints in this status: PENDING, COMMITTED, "
                                                 "ABANDONED, CORRUPT or DELETED.")
@paging()
@json_option
@pass_state
def ls(st: State, run: str, status: str | None, limit: int, offset: int) -> None:
    """List the checkpoints of RUN, newest step first."""
    page = st.rest.checkpoints(run, status.upper() if status else None, limit, offset)
    st.emit(page, lambda out: render.checkpoints(out, run, page))


@cli.command()
@click.argument("ckpt", type=CKPT_OR_RUN)
@json_option
@pass_state
def show(st: State, ckpt: CkptRef) -> None:
    """Show a checkpoint (status, tags, files, sizes, hashes), or with a bare RUN name the
    run: last-good, each rank's health, and the checkpoint interval (docs/health.md).

    With --json for a run: {"run": ..., "health": ...}.
    """
    if ckpt.run is not None and ckpt.tag is None:
        doc = {"run": st.rest.run(ckpt.run), "health": st.rest.health(ckpt.run)}
        st.emit(doc, lambda out: render.run(out, doc["run"], doc["health"]))
        return
    doc = st.rest.checkpoint(st.resolve(ckpt))
    st.emit(doc, lambda out: render.checkpoint(out, doc))


@cli.command()
@click.argument("run", type=RUN)
@click.option("--max-nodes", type=click.IntRange(0), default=50, show_default=True,
              help="Collapse the tree to about this many checkpoints (0: show all). Branch starts and "
                   "ends, fork points and last-good are always shown.")
@json_option
@pass_state
def lineage(st: State, run: str, max_nodes: int) -> None:
    """Draw the checkpoint tree of RUN, by branch.

    Each checkpoint shows its step, status, size and tags; last-good is highlighted.

    With --json: every node and edge (never collapsed).
    """
    doc = lineage_all(st.rest, run)
    st.emit(doc, lambda out: render.lineage_tree(out, doc, max_nodes))


@cli.command()
@click.argument("run", type=RUN)
@paging()
@json_option
@pass_state
def events(st: State, run: str, limit: int, offset: int) -> None:
    """List the events of RUN, oldest first.

    Begin, commit, abort, expired, corrupt, tag, pin, rollback, gc_delete ...
    """
    page = st.rest.events(run, limit, offset)
    st.emit(page, lambda out: render.events(out, run, page))


# ---------------------------------------------------------------- curation
@cli.command()
@click.argument("ckpt", type=CKPT)
@click.argument("name")
@click.option("--alias", is_flag=True, help="An alias names one checkpoint per run: setting it again moves it.")
@json_option
@pass_state
def tag(st: State, ckpt: CkptRef, name: str, alias: bool) -> None:
    """Tag a checkpoint with NAME.

    Only committed (or corrupt) checkpoints are tagged; GC keeps tagged checkpoints.
    """
    res = st.rest.tag(st.resolve(ckpt), name, alias)

    def human(out):
        parts = [("alias " if res["kind"] == "alias" else "tagged "), render.ckpt_id(res["checkpoint_id"]), " ",
                 Text(name, style="cyan")]
        if res.get("moved_from"):
            parts += [" (moved from ", render.ckpt_id(res["moved_from"], ""), ")"]
        render.line(out, *parts)
    st.emit(res, human)


@cli.command()
@click.argument("ckpt", type=CKPT)
@click.argument("name")
@json_option
@pass_state
def untag(st: State, ckpt: CkptRef, name: str) -> None:
    """Remove the tag or alias NAME from a checkpoint."""
    from lastgood.errors import NotFound

    cid = st.resolve(ckpt)
    try:
        res = st.rest.untag(cid, name)
    except NotFound as e:
        if e.no_route and "/" in name:
            # a service before 0.1.x decoded %2F before routing, so no route matched such a name
            raise CliError(f"this service cannot remove a tag whose name contains '/' ({name!r}) over "
                           f"REST", Exit.REFUSED) from None
        raise
    st.emit(res, lambda out: render.line(out, "untagged ", render.ckpt_id(res["checkpoint_id"]), " ",
                                         Text(name, style="cyan")))


def _pin(st: State, ckpt: CkptRef, pinned: bool) -> None:
    res = st.rest.pin(st.resolve(ckpt), pinned)
    st.emit(res, lambda out: render.line(out, "pinned " if pinned else "unpinned ",
                                         render.ckpt_id(res["checkpoint_id"])))


@cli.command()
@click.argument("ckpt", type=CKPT)
@json_option
@pass_state
def pin(st: State, ckpt: CkptRef) -> None:
    """Pin a checkpoint: GC never deletes it."""
    _pin(st, ckpt, True)


@cli.command()
@click.argument("ckpt", type=CKPT)
@json_option
@pass_state
def unpin(st: State, ckpt: CkptRef) -> None:
    """Unpin a checkpoint (retention decides again)."""
    _pin(st, ckpt, False)


# ---------------------------------------------------------------- gc, verify
@cli.command()
@click.option("--dry-run", is_flag=True, help="Only show the plan: what would go and the bytes freed.")
@click.option("--run", "run", type=RUN, default=None, help="With --dry-run: only this run's part of the plan.")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking (needed where no terminal can answer).")
@json_option
@pass_state
def gc(st: State, dry_run: bool, run: str | None, yes: bool) -> None:
    """Delete what nothing keeps (retention, tags, pins, leases).

    Without --dry-run it shows the plan, asks, and runs now, for every run (the service also
    runs it on its own schedule); --yes skips the question, and without a terminal to ask it
    is required. JSON: {"plan": ..., "dry_run": ..., "result": ...}; with --run, "run" too, and
    the plan holds that run's checkpoints only.
    """
    if run is not None and not dry_run:
        raise click.UsageError("--run filters the plan of --dry-run; GC itself runs for every run")
    if not dry_run and not yes:
        _confirm_gc(st.rest.gc_plan())
    if dry_run:
        plan = st.rest.gc_plan(full=True)  # what `lastgood gc` would do: every run, the store's orphans
        doc = {"plan": plan if run is None else render.plan_of_run(plan, run), "dry_run": True}
        if run is not None:
            doc["run"] = run
    else:
        doc = st.rest.gc()

    def human(out):
        render.gc_plan(out, doc["plan"], dry_run)
        if "result" in doc:
            render.gc_result(out, doc["result"])
    st.emit(doc, human)


def _confirm_gc(plan: dict) -> None:
    """Ask before deleting; where nobody can answer, refuse (exit 2) and say how to go on."""
    if not plan["checkpoints"] and not plan["orphans"]:
        return  # nothing to delete, nothing to ask
    what = render.gc_summary(plan, "gc would delete")
    if not sys.stdin.isatty():
        raise click.UsageError(f"{what}; pass --yes to delete without asking "
                               "(gc --dry-run shows the plan)")
    if not click.confirm(f"{what}. Delete?", default=False, err=True):
        raise click.UsageError("nothing deleted")


@cli.command()
@click.argument("ckpt", type=CKPT)
@json_option
@pass_state
def verify(st: State, ckpt: CkptRef) -> None:
    """Re-hash a checkpoint on the service; exit 5 if it is corrupt.

    A mismatch marks the checkpoint CORRUPT and moves last-good back.
    """
    res = st.rest.verify(st.resolve(ckpt))
    st.emit(res, lambda out: render.verify(out, res))
    if not res["ok"]:
        bad = res["bad"][0]
        where = f"rank {bad['rank']} file {bad['file']}" if "rank" in bad else bad["file"]
        click.echo(f"lastgood: error: checkpoint {res['checkpoint_id']} failed verification: {where} "
                   f"re-hashes to {bad['found']}, expected {bad['expected']}"
                   + (f" (and {len(res['bad']) - 1} more)" if len(res["bad"]) > 1 else ""), err=True)
        click.get_current_context().exit(Exit.VERIFICATION)
