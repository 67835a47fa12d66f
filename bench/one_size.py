"""One size of the benchmark: lastgood's save, restore and stall against DCP, torch.save and
the limits, on one state, every case interleaved with the others (bench/run.py runs it for
each size)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path


from bench.common import (GiB, MiB, ROOT, RssSampler, Service, build_state, drop_clean_cache, http_json, iqr_spread, median, order_of, proc_meminfo, proc_status, rm, settle, size_label, spread, state_bytes, state_tensors,
                          timed, vmstat, warm_files)
from bench.peers import CopyFloor, dcp_load, dcp_save, raw_write, torch_load, torch_save
from bench.pipe import PipeClient
from bench.report import CPU_OF, NOISE, PER_SIZE, RATIO_OF

SETTLED: list[float] = []  # seconds each case waited for the writeback before it (settle())
# save cases start with the clean page cache dropped (drop_clean_cache), unless --keep-cache;
# DROPPED counts the cases that did (dropping needs root)
FRESH_CACHE = [True]
DROPPED: list[bool] = []


def ratio(num: float, den: float, how: str) -> float:
    return den / num if how == "tput" else num / den


def log(msg: str) -> None:
    print(msg, flush=True)


def interleaved(cases: list, reps: int, fresh: bool = False):
    """Run every (name, case) once per repetition, in order_of's order; yields (repetition,
    the order it ran in) after each. `fresh`: each case starts with the clean page cache
    dropped too (the saves: each allocates its page cache from memory just freed,
    bench/common.drop_clean_cache; the restores, which then read their own files back
    into it: warm_files)."""
    for i in range(reps):
        order = order_of(cases, i)
        for _name, case in order:
            SETTLED.append(settle())  # no case inherits the dirty pages of the one before
            if fresh and FRESH_CACHE[0]:
                DROPPED.append(drop_clean_cache())
            case()
        yield i, order


@contextlib.contextmanager
def spool_off():
    """Checkpointers made inside stream their shards (LASTGOOD_USE_SPOOL=0 is read when one starts)."""
    old = os.environ.get("LASTGOOD_USE_SPOOL")
    os.environ["LASTGOOD_USE_SPOOL"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["LASTGOOD_USE_SPOOL"]
        else:
            os.environ["LASTGOOD_USE_SPOOL"] = old


def restored_blobs(svc: Service, data_dir: Path, run: str) -> Path:
    """The folder of the run's last-good in the service's local blob store: its key by
    domain/keys.py, its place by blobstore/local.py, the store where the service's
    default puts it (<data_dir>/blobs, settings.resolved_blob_url)."""
    from lastgood_service.blobstore.local import key_path
    from lastgood_service.domain import keys

    lg = http_json(f"{svc.url}/api/v1/runs/{run}/last-good")
    folder = key_path(data_dir / "blobs", keys.prefix(lg["id"], run, lg["step"], lg["attempt"]).rstrip("/"))
    assert folder.is_dir(), folder
    return folder


def least_cached(warmed: dict) -> str:
    """The smallest share of its files that any restore case of the last rep found cached."""
    shares = [w[-1]["cached_after"] for w in warmed.values() if w[-1]["cached_after"] is not None]
    return f"{min(shares):.0%}" if shares else "unknown"


# ---------------------------------------------------------------------------- pipe server
class Pipe:
    def __init__(self, work: Path) -> None:
        port_file = work / "pipe.port"
        rm(port_file)
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.pipe", "serve", str(port_file)], cwd=ROOT)
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the gRPC pipe server did not start")
            time.sleep(0.05)
        self.client = PipeClient(int(port_file.read_text()))

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)


# ---------------------------------------------------------------------------- one size
SERVICE_ENV = {"LASTGOOD_RETENTION": "latest:1,last-good,branch-heads", "LASTGOOD_GC_INTERVAL": "0",
               "LASTGOOD_GC_GRACE_SECONDS": "0"}


def size_block(target: int, reps: int, work: Path, pipe: Pipe) -> dict:
    import lastgood

    label = size_label(target)
    t_build = time.perf_counter()
    model, opt = build_state(target)
    tensors = state_tensors(model, opt)
    nbytes = state_bytes(model, opt)
    log(f"\n== {label}: {nbytes / MiB:.1f} MiB in {len(tensors)} tensors "
        f"({sum(1 for _ in model.parameters())} parameters + AdamW moments), built in "
        f"{time.perf_counter() - t_build:.1f} s; {reps} reps")
    times: dict[str, list[float]] = {k: [] for k in PER_SIZE}
    cpu: dict[str, list[float]] = {k: [] for k in CPU_OF}
    loads: list[float] = []  # the 1-minute load average after each save rep  # the client's CPU (this process), not the service's
    block_vmstat: list[dict] = []  # /proc/vmstat deltas while each async save() blocked
    block_cpu: list[float] = []
    rss_peaks: list[int] = []  # during streamed saves: the service holds the stream's chunks
    spool_rss_peaks: list[int] = []

    floor = CopyFloor(tensors)
    svc = Service(work / f"svc-{target}", SERVICE_ENV).start()
    mem_at = {"saves": proc_meminfo("MemAvailable")}  # what the page cache had to work with
    base_rss = proc_status(svc.pid, "VmRSS")
    run = f"bench-{target}-{uuid.uuid4().hex[:6]}"
    state = lastgood.TrainState(model=model, optimizer=opt)
    # one launch (one attempt): two Checkpointers of the same run in one process are one job,
    # not a relaunch that would fence the first (docs/fencing.md)
    attempt = uuid.uuid4().hex[:16]
    ckpt = lastgood.Checkpointer(svc.url, run=run, attempt=attempt)
    with spool_off():  # the same saves, streamed over gRPC as from another host
        streamer = lastgood.Checkpointer(svc.url, run=run, attempt=attempt)
    # the same spooled saves as one file per rank (LASTGOOD_FILE_BYTES=0; the default splits: state/split.py)
    one_file = lastgood.Checkpointer(svc.url, run=run, attempt=attempt)
    one_file.config = dataclasses.replace(one_file.config, file_bytes=0)
    # one job holds one Checkpointer, so one staging pool: the three here exist only to
    # compare data paths in one run, and three pools (a state-sized buffer each) would
    # leave a 4 GiB state's writes too little page cache, which no real job suffers
    streamer._pool = one_file._pool = ckpt._pool
    assert ckpt.transport.spool is not None and streamer.transport.spool is None
    files = work / "files"
    files.mkdir(exist_ok=True)
    raw_path, pt_path, dcp_path = files / "raw.bin", files / "state.pt", files / "dcp"
    step = 0
    try:
        # warm-up: lastgood allocates its staging buffer once and reuses it for every save
        t_cold = timed(lambda: (ckpt.save(step, state), ckpt.wait()))
        step += 1
        timed(lambda: (streamer.save(step, state), streamer.wait()))
        step += 1
        timed(lambda: (one_file.save(step, state), one_file.wait()))
        svc.gc()
        log(f"  lastgood warm-up save (allocates the staging buffer): {t_cold:.2f} s")
        step_box = [step]

        def sync_save(key: str, saver, peaks: list):
            def case():
                step_box[0] += 1
                with RssSampler(svc.pid) as rss:
                    times[key].append(timed(lambda: (saver.save(step_box[0], state), saver.wait()), cpu.get(key)))
                peaks.append(rss.peak)
                svc.gc()
            return case

        lg_sync = sync_save("lastgood_save_sync", ckpt, spool_rss_peaks)
        lg_stream = sync_save("lastgood_save_stream", streamer, rss_peaks)
        lg_one = sync_save("lastgood_save_one_file", one_file, [])

        def lg_async():
            step_box[0] += 1
            times["copy_floor"].append(floor.once())  # the floor, measured right before
            before, c0 = vmstat(), time.thread_time()
            t0 = time.perf_counter()
            ckpt.save(step_box[0], state)
            t1 = time.perf_counter()
            block_cpu.append(time.thread_time() - c0)  # the calling thread's own CPU: working, or waiting?
            after = vmstat()  # what the machine's memory management did while save() blocked
            block_vmstat.append({k: after[k] - before[k] for k in after if k in before})
            ckpt.wait()
            t2 = time.perf_counter()
            times["lastgood_save_async_block"].append(t1 - t0)
            times["lastgood_save_async_commit"].append(t2 - t0)
            svc.gc()

        saves = [("raw", lambda: times["raw_write_fsync"].append(raw_write(raw_path, nbytes))),
                 ("torch.save", lambda: times["torch_save"].append(torch_save(model, opt, pt_path))),
                 ("DCP", lambda: times["dcp_save"].append(dcp_save(model, opt, dcp_path, cpu["dcp_save"]))),
                 ("lastgood sync", lg_sync), ("lastgood one file", lg_one), ("lastgood stream", lg_stream),
                 ("lastgood async", lg_async)]
        for i, order in interleaved(saves, reps, fresh=True):
            loads.append(os.getloadavg()[0])
            log(f"  save rep {i + 1} (load {loads[-1]:.1f}) ({' > '.join(n for n, _ in order)}): raw {times['raw_write_fsync'][-1]:.2f} s, "
                f"torch.save {times['torch_save'][-1]:.2f} s, DCP {times['dcp_save'][-1]:.2f} s, lastgood sync "
                f"{times['lastgood_save_sync'][-1]:.2f} s / one file {times['lastgood_save_one_file'][-1]:.2f} s / streamed {times['lastgood_save_stream'][-1]:.2f} s "
                f"(service RSS peak {rss_peaks[-1] / MiB:.0f} MiB), copy floor "
                f"{times['copy_floor'][-1]:.3f} s, async blocks {times['lastgood_save_async_block'][-1]:.3f} s / "
                f"commits {times['lastgood_save_async_commit'][-1]:.2f} s")
        # the last commit, which the restores read, is split as the default splits it (the
        # last rep may have ended on the one-file case)
        step = step_box[0] + 1
        timed(lambda: (ckpt.save(step, state), ckpt.wait()))
        floor.free()
        hwm_after_ingest = proc_status(svc.pid, "VmHWM")
        ckpt.close()  # frees the staging buffers before the restores allocate theirs
        streamer.close()
        one_file.close()
        del ckpt, streamer, one_file
        gc.collect()

        reader = lastgood.Checkpointer(svc.url, run=run, attempt=attempt)
        with spool_off():
            stream_reader = lastgood.Checkpointer(svc.url, run=run, attempt=attempt)
        # one pool, as for the saves: a second state-sized buffer would take 4 GiB of the
        # page cache the restores of a 4 GiB state read from, which no job with one
        # Checkpointer gives up
        stream_reader._pool = reader._pool
        mem_at["restores"] = proc_meminfo("MemAvailable")
        got = []

        def restore(key: str, restorer):
            def case():
                times[key].append(timed(lambda: got.append(restorer.restore(state)), cpu.get(key)))
                assert got[-1] == step, (got, step)
                gc.collect()
            return case

        lg_restore = restore("lastgood_restore", reader)
        lg_restore_stream = restore("lastgood_restore_stream", stream_reader)

        def ceiling():
            times["grpc_download"].append(pipe.client.download(nbytes))
            times["grpc_upload"].append(pipe.client.upload(nbytes))

        # each restore case starts as each save case does, with the clean page cache
        # dropped, and then reads its own files back through it, untimed (warm_files): so
        # every method restores with its files, and only its files, in the page cache. At
        # 4 GiB three state-sized files, the state and the restores' buffers outgrow this
        # machine's memory: with the files left to compete, the order decided which came
        # back cold (lastgood 0.61-1.92 s, DCP 1.42-4.27 s in one run), and even a file read
        # through right before its case was 28-92 % cached when it began.
        # the restored commit's objects alone: the other Checkpointers' branch heads stay too
        blobs = restored_blobs(svc, work / f"svc-{target}", run)
        warmed: dict[str, list[dict]] = {}

        def warm_first(key: str, paths: list, case):
            def run_case():
                warmed.setdefault(key, []).append(warm_files(paths))
                case()
            return run_case

        restores = [("torch.load", warm_first("torch_load", [pt_path],
                                              lambda: times["torch_load"].append(torch_load(model, opt, pt_path)))),
                    ("DCP load", warm_first("dcp_load", [dcp_path], lambda: times["dcp_load"].append(
                        dcp_load(model, opt, dcp_path, cpu["dcp_load"])))),
                    ("lastgood", warm_first("lastgood_restore", [blobs], lg_restore)),
                    ("lastgood streamed", warm_first("lastgood_restore_stream", [blobs], lg_restore_stream)),
                    ("gRPC", ceiling)]
        # one untimed pass of every restore case first, as lastgood's saves get a warm-up
        # save: lastgood's first restore allocates the staging buffer every later one
        # reuses, and each method pays its first-call costs here (before the per-case warm
        # above, the first rep was also a cold read for lastgood alone: the service drops a
        # large file's pages behind its hash). A restore with nothing cached, for every
        # method alike, is bench.cold_restore's.
        marks = {k: len(v) for k, v in times.items()}, {k: len(v) for k, v in cpu.items()}
        for _name, case in restores:
            settle()
            if FRESH_CACHE[0]:
                drop_clean_cache()
            case()
        warmup = {k: v[marks[0][k]:] for k, v in times.items() if len(v) > marks[0][k]}
        for table, mark in ((times, marks[0]), (cpu, marks[1])):
            for k, v in table.items():
                del v[mark[k]:]
        log("  restore warm-up (untimed): " + ", ".join(f"{k} {v[0]:.2f} s" for k, v in warmup.items()))
        for i, order in interleaved(restores, reps, fresh=True):
            log(f"  restore rep {i + 1} ({' > '.join(n for n, _ in order)}): torch.load {times['torch_load'][-1]:.2f} s, "
                f"DCP load {times['dcp_load'][-1]:.2f} s, lastgood {times['lastgood_restore'][-1]:.2f} s / streamed "
                f"{times['lastgood_restore_stream'][-1]:.2f} s, gRPC "
                f"ceiling down {times['grpc_download'][-1]:.2f} s / up {times['grpc_upload'][-1]:.2f} s; the least "
                f"cached after warming: {least_cached(warmed)}")
        reader.close()
        stream_reader.close()
    finally:
        svc.stop()
        for p in (raw_path, pt_path, dcp_path):
            rm(p)
        shutil.rmtree(work / f"svc-{target}", ignore_errors=True)

    med = {k: median(v) for k, v in times.items()}
    gib = nbytes / GiB
    figures = {k: {"seconds": times[k], "median_s": med[k], "gib_per_s": gib / med[k] if med[k] else None,
                   "min_s": min(times[k]), "max_s": max(times[k]), "spread": spread(times[k]),
                   "iqr_spread": iqr_spread(times[k])}
               for k in PER_SIZE}
    ratios = {k: ratio(med[a], med[b], how) for k, (a, b, how) in RATIO_OF.items()}
    # the same ratio rep by rep (the cases of one rep ran back to back), and whether either
    # figure spread too wide for the median ratio to mean anything
    ratio_reps = {k: [ratio(x, y, how) for x, y in zip(times[a], times[b])] for k, (a, b, how) in RATIO_OF.items()}
    noisy = {k: max(figures[a]["iqr_spread"], figures[b]["iqr_spread"]) > NOISE for k, (a, b, _) in RATIO_OF.items()}
    del model, opt, state, tensors
    gc.collect()
    cpu_per_gib = {k: {"seconds": v, "median_s_per_gib": median(v) / gib} for k, v in cpu.items() if v}
    return {"label": label, "cpu": cpu_per_gib, "loadavg_per_rep": loads, "target_bytes": target, "bytes": nbytes, "reps": reps, "figures": figures,
            "ratios": ratios, "ratio_reps": ratio_reps, "noisy": noisy, "lastgood_cold_first_save_s": t_cold,
            "async_block_vmstat_reps": block_vmstat, "async_block_thread_cpu_s": block_cpu,
            "restore_warmup_s": {k: v[0] for k, v in warmup.items()},
            # what each restore case read through the page cache before it (warm-up pass
            # first), and the share of it cached afterwards: the "warm" the figures claim
            "restore_warmed": warmed,
            "mem_available_mib": {k: v / MiB for k, v in mem_at.items()},
            "service_rss": {"baseline_mib": base_rss / MiB, "peak_mib_reps": [p / MiB for p in rss_peaks],
                            "peak_mib": median(rss_peaks) / MiB, "vmhwm_after_ingest_mib": hwm_after_ingest / MiB,
                            "spool_peak_mib_reps": [p / MiB for p in spool_rss_peaks],
                            "spool_peak_mib": median(spool_rss_peaks) / MiB}}
