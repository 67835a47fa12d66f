"""Export throughput against reading the same bytes from the store, and the export's memory.

    python -m bench.export [--sizes 256MiB,1GiB] [--reps 3] [--out bench/results] [--workdir /tmp]

For each size, a GPT-style state (bench.common.build_state: fp32 weights plus AdamW's two
moments, so the weights are a third of the bytes) is saved by one Checkpointer to a real
service process. Then, interleaved rep by rep (each rep starting with the other case):

- read: every byte of the checkpoint's rank file streamed from the service over REST and
  hashed with xxh3-128, then dropped — `lastgood download`'s reader
  (cli/download.read_verified), the floor of any verified export from the store;
- download: `lastgood download` of the same checkpoint (the same reader, every file written
  to DIR/rank{R}/ and fsynced): what fetching a checkpoint to stitch it by hand costs first;
- export: `lastgood.export.export_hf` of the same checkpoint into a new directory (read and
  hash the same bytes, copy the weights into the scratch file, write model.safetensors,
  index and config, fsync, rename);
- export bf16: the same with `dtype="bf16"` (every weight converted in NumPy).

Each case runs in a fresh Python process that times its own work (start-up excluded) and
whose peak RSS (its VmHWM, at the end) is recorded: the read case's peak is the baseline
(interpreter, imports, the reader's buffers); the export's peak above it is what the
export itself holds. The figure to compare is the largest tensor: a tensor sharded in dim-0
blocks (FSDP2, DDP, one rank) is streamed in blocks, never held whole. Writes
bench/results/export.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import MiB, ROOT, Service, build_state, machine, median, order_of, parse_size, proc_status, size_label

CASES = ("read", "download", "export", "export_bf16")


def child(case: str, url: str, cid: int, dest: str) -> None:
    """One case, timed from inside (no interpreter start-up in the figure)."""
    from lastgood.export import export_hf
    from lastgood.remote.reading import ReadLease, read_manifest, read_verified
    from lastgood.remote.rest import RestClient

    t0 = time.perf_counter()
    if case == "read":
        rest = RestClient(url, 60)
        n = 0
        with ReadLease(rest, cid, what="bench") as lease:
            _, manifest = read_manifest(rest, cid)
            for r in sorted(manifest.ranks):
                for e in manifest.files(r):
                    for chunk in read_verified(rest, cid, r, e, lease):
                        n += len(chunk)
        doc = {"bytes_read": n}
    elif case == "download":
        from lastgood.cli import cli

        cli.main(args=["--url", url, "download", str(cid), dest], standalone_mode=False)
        doc = {"bytes_read": sum(p.stat().st_size for p in Path(dest).rglob("rank*.safetensors"))}
    else:
        doc = export_hf(cid, dest, url=url, dtype="bf16" if case == "export_bf16" else None)
    seconds = time.perf_counter() - t0
    # VmHWM, not ru_maxrss: Linux folds the parent's RSS at fork into the child's ru_maxrss
    peak = proc_status(os.getpid(), "VmHWM")
    print(json.dumps({"seconds": seconds, "bytes_read": doc["bytes_read"], "total_size": doc.get("total_size"),
                      "peak_rss": peak}))


def run_case(case: str, url: str, cid: int, dest: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.export", "--child", case, url, str(cid), str(dest)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_size(size: int, reps: int, work: Path) -> dict:
    import lastgood

    model, opt = build_state(size)
    largest = max(p.nbytes for p in model.parameters())
    weights = sum(p.nbytes for p in model.parameters())
    svc = Service(work / "svc", {"LASTGOOD_GC_INTERVAL": "0", "LASTGOOD_LEASE_SECONDS": "120"}).start()
    try:
        with lastgood.Checkpointer(svc.url, run="bench-export", attempt="bench") as ckpt:
            ckpt.save(1, lastgood.TrainState(model=model, optimizer=opt))
            ckpt.wait()
            cid = ckpt.last_saved.checkpoint_id
        del model, opt
        rows: dict[str, list[dict]] = {c: [] for c in CASES}
        for rep in range(reps):
            order = order_of(list(CASES), rep)
            for case in order:
                dest = work / f"out-{case}-{rep}"
                rows[case].append(run_case(case, svc.url, cid, dest))
                shutil.rmtree(dest, ignore_errors=True)
    finally:
        svc.stop()
        shutil.rmtree(work / "svc", ignore_errors=True)
    read = rows["read"]
    block = {"label": size_label(size), "state_bytes": read[0]["bytes_read"], "weights_bytes": weights,
             "largest_tensor_bytes": largest, "reps": rows, "figures": {}, "ratios": {}}
    for case in CASES:
        secs = [r["seconds"] for r in rows[case]]
        block["figures"][case] = {"seconds": secs, "median_s": median(secs),
                                  "gib_per_s_read": read[0]["bytes_read"] / median(secs) / 2**30,
                                  "peak_rss_mib": median([r["peak_rss"] for r in rows[case]]) / MiB}
    for case in ("export", "export_bf16"):
        # rep by rep, each against the read (and the download) of the same rep
        for base in ("read", "download"):
            block["ratios"][f"{case}_over_{base}"] = median([e["seconds"] / r["seconds"]
                                                             for e, r in zip(rows[case], rows[base])])
        extra = block["figures"][case]["peak_rss_mib"] - block["figures"]["read"]["peak_rss_mib"]
        block["figures"][case]["rss_above_read_mib"] = extra
    return block


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.export")
    ap.add_argument("--sizes", default="256MiB,1GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    doc = {"bench": "export", "machine": machine(), "reps": args.reps, "sizes": []}
    with tempfile.TemporaryDirectory(prefix="lastgood-bench-export-", dir=args.workdir) as work:
        for text in args.sizes.split(","):
            block = one_size(parse_size(text), args.reps, Path(work))
            doc["sizes"].append(block)
            f = block["figures"]
            print(f"{block['label']}: state {block['state_bytes'] / MiB:.0f} MiB, largest tensor "
                  f"{block['largest_tensor_bytes'] / MiB:.1f} MiB | read {f['read']['median_s']:.2f} s "
                  f"({f['read']['gib_per_s_read']:.2f} GiB/s), download {f['download']['median_s']:.2f} s, "
                  f"export {f['export']['median_s']:.2f} s "
                  f"(x{block['ratios']['export_over_read']:.2f} read, x{block['ratios']['export_over_download']:.2f} "
                  f"download), bf16 {f['export_bf16']['median_s']:.2f} s "
                  f"(x{block['ratios']['export_bf16_over_read']:.2f}) | peak RSS read "
                  f"{f['read']['peak_rss_mib']:.0f} MiB, export +{f['export']['rss_above_read_mib']:.0f} MiB, "
                  f"bf16 +{f['export_bf16']['rss_above_read_mib']:.0f} MiB", flush=True)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "export.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main(sys.argv[1:])
