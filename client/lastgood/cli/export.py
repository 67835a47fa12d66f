"""`lastgood export CKPT DIR`: a checkpoint as a Hugging Face model directory or a stock DCP
directory (lastgood.export); `lastgood import-dcp DIR`: a stock DCP directory into a run
(lastgood.dcp.stock)."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from pathlib import Path

import click
from rich.text import Text

from lastgood.errors import FormatError
from lastgood.cli import render
from lastgood.cli.app import CKPT, RUN, CkptRef, CliError, Exit, State, cli, json_option, pass_state


@cli.command("export")
@click.argument("ckpt", type=CKPT)
@click.argument("dest", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["hf", "dcp"]), default="hf", show_default=True,
              help="hf: model.safetensors (or model-0000k-of-0000N.safetensors) + model.safetensors.index.json "
                   "+ config.json. dcp: a torch.distributed.checkpoint directory (.metadata, __0_0.distcp) that "
                   "stock FileSystemReader and dcp_to_torch_save read; needs torch.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Convert the float tensors to this dtype. Default: as stored.")
@click.option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE",
              help="Largest output file: 5GB (10^9 bytes), 500MiB (2^20), or bytes. A larger tensor gets "
                   "a file of its own.")
@click.option("--prefix", default=None,
              help="Export the module tensors whose state name starts with this, without it "
                   "(TrainState(model=...) names them model.<state_dict key>). Default: model. for hf; "
                   "nothing for dcp (names kept whole).")
@click.option("--map", "name_map", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="JSON object renaming tensors: {\"name after the prefix\": \"name in the export\"}; "
                   "null drops a tensor.")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="config.json to write into DIR. Default: the training state's extra[\"hf_config\"], "
                   "if it has one.")
@click.option("--progress/--no-progress", default=None,
              help="Show progress on stderr. Default: when stderr is a terminal and not --json.")
@json_option
@pass_state
def export(st: State, ckpt: CkptRef, dest: Path, fmt: str, dtype: str | None, max_shard_size: str, prefix: str,
           name_map: Path | None, config: Path | None, progress: bool | None) -> None:
    """Write a checkpoint's model weights as a Hugging Face model directory DIR, or as a
    stock DCP directory (--format dcp: a lastgood.dcp save whole, a Checkpointer save's
    module tensors).

    Reads, from the store, the rank files that hold model tensors (each streamed once and
    verified against the manifest's xxh3-128), assembles every tensor from its shards
    (FSDP2 at any world size, DDP replicas from one rank), and writes safetensors files,
    the index and config.json into a temporary directory that becomes DIR only when all
    is written: a failed or interrupted export leaves no DIR. Optimizer state and RNGs
    are not exported. Exit 5 if a byte does not verify.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from lastgood.export import ExportError, Options, run_export

    try:
        opts = Options(dtype, max_shard_size, prefix, name_map, config, fmt)
    except ExportError as e:
        raise click.UsageError(str(e)) from None
    show = progress if progress is not None else (st.err.is_terminal and not st.json)
    bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), console=st.err, disable=not show, transient=False)
    tasks: dict[str, int] = {}

    def advance(n: int, what: str) -> None:
        if what not in tasks:
            tasks[what] = bar.add_task({"read": "read + verify", "skip": "not needed", "write": "write"}[what],
                                       total=None)
        bar.advance(tasks[what], n)

    # SIGTERM (a scheduler's stop) unwinds like Ctrl-C, so the temporary directory goes too
    previous = signal.signal(signal.SIGTERM, _interrupt)
    if fmt == "dcp":
        with _torch_for("export --format dcp"):
            import lastgood.export.dcp  # noqa: F401 - torch's DCP writer, before anything is read
    try:
        with bar:
            doc = run_export(st.rest, ckpt, dest, opts, advance)
    except ExportError as e:
        raise CliError(str(e), Exit.USAGE) from None
    except FormatError as e:
        raise CliError(f"the checkpoint cannot be exported: {e}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)

    def human(out):
        table = render.make_table("FILE", "SIZE", "TENSORS")
        table.columns[1].justify = table.columns[2].justify = "right"
        for f in doc["files"]:
            table.add_row(Text(str(dest / f["name"])), Text(render.fmt_bytes(f["size"])),
                          Text(str(f.get("tensors", ""))))
        out.print(table)
        render.line(out, Text("exported ", style="bold"), render.ckpt_id(doc["checkpoint_id"]), " (run ",
                    Text(doc["run"]), f", step {doc['step']}, world size {doc['world_size']}): {doc['tensors']} "
                    f"tensors, {render.fmt_bytes(doc['total_size'])}"
                    f"{' as ' + doc['dtype'] if doc['dtype'] else ''}; read {len(doc['read'])} rank file(s), "
                    f"{render.fmt_bytes(doc['bytes_read'])}, every xxh3-128 verified; " +
                    (f"config.json: {doc['config'] or 'none'}" if doc["format"] == "hf" else
                     f"stock DCP: {doc['chunks']} chunk(s), {doc['values']} non-tensor value(s)"))
    st.emit(doc, human)


@cli.command("import-dcp")
@click.argument("src", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--run", "run", type=RUN, required=True, help="The run to import into (created if it does not exist).")
@click.option("--step", type=click.IntRange(min=0), required=True, help="The step the checkpoint is saved as.")
@click.option("--parent", "parent", type=click.IntRange(min=1), default=None,
              help="The checkpoint id of its parent in the lineage. Default: the run's last-good.")
@json_option
@pass_state
def import_dcp(st: State, src: Path, run: str, step: int, parent: int | None) -> None:
    """Import a stock DCP directory DIR (dcp.save with FileSystemWriter) into RUN as a
    committed checkpoint of STEP, which lastgood.dcp.StorageReader restores.

    DCP's .metadata is a pickle: it is read only through torch's weights-only unpickler
    with DCP's metadata classes allowed (a file that names anything else is refused, and
    nothing of it runs); tensors and values load weights-only too. The whole state is
    held in memory once. Needs torch.
    """
    with _torch_for("import-dcp"):
        from lastgood.dcp.stock import import_dcp as run_import
    doc = run_import(src, step=step, url=st.url, run=run, token=st.token, parent_id=parent)

    def human(out):
        render.line(out, Text("imported ", style="bold"), Text(str(src)), " as ",
                    render.ckpt_id(doc["checkpoint_id"]), " (run ", Text(doc["run"]),
                    f", step {doc['step']}): {doc['tensors']} tensors, {render.fmt_bytes(doc['bytes'])}, "
                    f"{doc['values']} non-tensor value(s); committed")
    st.emit(doc, human)


@contextmanager
def _torch_for(what: str):
    """The two commands that need torch say so when it is not installed."""
    try:
        yield
    except ImportError as e:
        if e.name != "torch" and not str(e.name or "").startswith("torch."):
            raise
        raise CliError(f"{what} needs torch, which this Python does not have (pip install torch)") from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt
