"""Profile a service process under bench/control_plane.py --profile (never imported otherwise).

The benchmark puts this folder first on the service's PYTHONPATH, so Python imports it at
start-up: yappi (CPU clock, every thread) runs from then on. A file <OUT>.clear clears what
it has counted (the benchmark makes it just before the vote storm); <OUT>.dump writes the
counts so far to OUT = $LASTGOOD_BENCH_PROFILE_OUT (just after): the event loop's thread
(uvicorn's: the waiters), then all threads together (the gRPC workers add the votes and the
commit). Files, not signals: a loop idle in uvloop's C code runs no Python signal handler."""

import os
import time
import threading

import yappi

OUT = os.environ["LASTGOOD_BENCH_PROFILE_OUT"]
yappi.set_clock_type("cpu")
yappi.start(builtins=False, profile_threads=True)


def _clear():
    yappi.clear_stats()


def _dump():
    main = threading.main_thread().ident
    threads = {t.id: (t.name, t.tid, t.ttot) for t in yappi.get_thread_stats()}
    loop = [i for i, (_name, tid, _t) in threads.items() if tid == main]
    with open(OUT + ".part", "w") as f:
        f.write("threads (cpu s): " + ", ".join(f"{n}={t:.3f}" for n, _tid, t in
                                                  sorted(threads.values(), key=lambda x: -x[2])[:12]) + "\n")
        # one filtered read per group: a read per thread (a hundred) took minutes
        for title, stats in (("event loop thread", yappi.get_func_stats(filter={"ctx_id": loop[0]})),
                             ("all threads", yappi.get_func_stats())):
            for key in ("ttot", "tsub"):
                f.write(f"\n== {title}: top by {key} ==\n")
                stats.sort(key, "desc")
                for s in list(stats)[:30]:
                    f.write(f"{s.ttot:8.3f} {s.tsub:8.3f} {s.ncall:8d}  {s.module.split('site-packages/')[-1]}:"
                            f"{s.lineno} {s.name}\n")
    os.replace(OUT + ".part", OUT)  # whole, or not there


def _control():
    while True:
        time.sleep(0.1)
        for name, act in (("clear", _clear), ("dump", _dump)):
            if os.path.exists(f"{OUT}.{name}"):
                os.unlink(f"{OUT}.{name}")
                act()


threading.Thread(target=_control, name="bench-profile", daemon=True).start()
