"""The GPU path, measured on one CUDA device in one run (`make bench-gpu`):

    python -m bench.gpu                              # on the first CUDA device, a 2 GiB state
    python -m bench.gpu --device cpu --size 16M      # the CPU fallback CI runs (tests/bench)

Four figures, each a same-run ratio against its peer or limit:

  snapshot stall    what `save()` blocks the trainer for, against a plain device-to-host copy
                    of the same tensors into pinned memory (the least a snapshot can cost)
  D2H bandwidth     that plain copy's GB/s, against the device's PCIe limit (--pcie-gbps;
                    public measurements of H100/H200-class parts show ~55 GB/s pinned)
  step time         a GPT-style training loop with a save every --save-every steps, against
                    the same loop without saves (the goal: <= 1.05x)
  restore           `restore()` into the device's tensors, against a plain host-to-device
                    copy of the same bytes from pinned memory

Without CUDA (or with --device cpu) the same cases run on CPU tensors, so the bench cannot
rot; its figures then say nothing of a GPU and the JSON says so ("fallback": true). Writes
bench/results/gpu-<device>.json. Sized to finish in well under 8 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import ROOT, Service, build_state, machine, parse_size, size_label, state_tensors, write_results

H200_PINNED_GBPS = 55.0  # public pinned D2H measurements of H100/H200-class parts on PCIe Gen5 x16


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def to_device(model, opt, device) -> None:
    """Model and optimizer state onto `device`, the parameters keeping their identity (the
    optimizer's state is keyed by them)."""
    model.to(device)
    for st in opt.state.values():
        for k, v in list(st.items()):
            if hasattr(v, "to") and k != "step":
                st[k] = v.to(device)


def forward_loss(model, idx):
    """A pre-LN GPT forward over build_state's modules (it builds them without one)."""
    import torch.nn.functional as F

    b, t = idx.shape
    x = model.tok(idx) + model.pos.weight[:t]
    for blk in model.blocks:
        h = blk.ln1(x)
        q, k, v = blk.qkv(h).chunk(3, dim=-1)
        heads = max(1, q.shape[-1] // 64)
        q, k, v = (z.view(b, t, heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + blk.proj(a)
        x = x + blk.fc_out(F.gelu(blk.fc(blk.ln2(x))))
    logits = model.ln_f(x) @ model.tok.weight.t()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _pinned(nbytes: int, device):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def _copy_out(tensors, host) -> None:
    """Every tensor into one host buffer, back to back: the plain snapshot."""
    off = 0
    for t in tensors:
        n = t.nbytes
        host[off:off + n].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
        off += n


def _copy_in(tensors, host) -> None:
    off = 0
    for t in tensors:
        n = t.nbytes
        t.detach().copy_(host[off:off + n].view(t.dtype).view(t.shape), non_blocking=True)
        off += n


def _train(model, opt, device, steps: int, batch: int, ctx: int, every: int, save) -> list[float]:
    """Per-step seconds of `steps` training steps; save(i) after every `every`-th step."""
    import torch

    vocab = model.tok.weight.shape[0]
    g = torch.Generator(device="cpu").manual_seed(1)
    times = []
    for i in range(1, steps + 1):
        idx = torch.randint(0, vocab, (batch, ctx), generator=g).to(device)

        def one():
            opt.zero_grad(set_to_none=True)
            forward_loss(model, idx).backward()
            opt.step()
            if every and i % every == 0:
                save(i)
        times.append(_timed(one, device))
    return times


def _stats(xs: list[float]) -> dict:
    return {"seconds": xs, "median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto (the first CUDA device, else CPU), cuda, cuda:N or cpu")
    ap.add_argument("--size", default=None, help="state size (weights + Adam moments); default 2G on CUDA, 16M on CPU")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="training steps per loop (with saves, and without)")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pcie-gbps", type=float, default=H200_PINNED_GBPS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    import lastgood

    name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = torch.device(name)
    fallback = device.type != "cuda"
    target = parse_size(args.size or ("16M" if fallback else "2G"))
    model, opt = build_state(target)
    to_device(model, opt, device)
    tensors = state_tensors(model, opt)
    nbytes = sum(t.nbytes for t in tensors)
    ctx = min(model.pos.weight.shape[0], 256)
    work = Path(tempfile.mkdtemp(prefix="lastgood-gpu-", dir="/tmp"))
    svc = Service(work / "svc", {"LASTGOOD_LOG_LEVEL": "WARNING"}).start()
    state = lastgood.TrainState(model=model, optimizer=opt)
    ckpt = lastgood.Checkpointer(svc.url, run=f"gpu-{uuid.uuid4().hex[:6]}")
    host = _pinned(nbytes, device)
    doc: dict = {"command": "python -m bench.gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "machine": machine(), "device": str(device), "fallback": fallback, "bytes": nbytes,
                 "size": size_label(nbytes), "reps": args.reps}
    if not fallback:
        doc["device_name"] = torch.cuda.get_device_name(device)
    step = [0]
    try:
        _copy_out(tensors, host)  # warm-up: pinned pages touched, the staging buffers allocated
        step[0] += 1
        ckpt.save(step[0], state)
        ckpt.wait()
        plain, stall, commit = [], [], []
        for _ in range(args.reps):
            plain.append(_timed(lambda: _copy_out(tensors, host), device))
            step[0] += 1
            stall.append(_timed(lambda: ckpt.save(step[0], state), device))
            t0 = time.perf_counter()
            ckpt.wait()
            commit.append(time.perf_counter() - t0 + stall[-1])
        gbps = nbytes / 1e9 / statistics.median(plain)
        doc["snapshot"] = {"plain_d2h": _stats(plain), "save_stall": _stats(stall), "save_to_commit": _stats(commit),
                           "stall_vs_plain": statistics.median(stall) / statistics.median(plain),
                           "stall_vs_plain_reps": [s / p for s, p in zip(stall, plain)]}
        doc["d2h"] = {"gb_per_s": gbps, "limit_gb_per_s": args.pcie_gbps, "vs_limit": gbps / args.pcie_gbps,
                      "limit_note": "pinned D2H measured on H100/H200-class parts (PCIe Gen5 x16)"
                      if not fallback else "CPU fallback: a host memcpy, no PCIe link"}

        def save_at(i):
            step[0] += 1
            ckpt.save(step[0], state)
        _train(model, opt, device, 3, args.batch, ctx, 0, save_at)  # warm-up: kernels, allocator
        without = _train(model, opt, device, args.steps, args.batch, ctx, 0, save_at)
        with_saves = _train(model, opt, device, args.steps, args.batch, ctx, args.save_every, save_at)
        ckpt.wait()
        doc["step_time"] = {"without_saves": _stats(without), "with_saves": _stats(with_saves),
                            "save_every": args.save_every, "goal": 1.05,
                            "mean_vs_without": statistics.mean(with_saves) / statistics.mean(without)}

        step[0] += 1
        ckpt.save(step[0], state)
        ckpt.wait()
        h2d, restore = [], []
        for _ in range(args.reps):
            _copy_out(tensors, host)
            h2d.append(_timed(lambda: _copy_in(tensors, host), device))
            restore.append(_timed(lambda: ckpt.restore(state), device))
        doc["restore"] = {"plain_h2d": _stats(h2d), "restore": _stats(restore),
                          "plain_vs_restore": statistics.median(h2d) / statistics.median(restore),
                          "h2d_gb_per_s": nbytes / 1e9 / statistics.median(h2d)}
    finally:
        ckpt.close()
        svc.stop()
        shutil.rmtree(work, ignore_errors=True)
    path = write_results(args.out, f"gpu-{device.type}", doc)
    s, d, st, r = doc["snapshot"], doc["d2h"], doc["step_time"], doc["restore"]
    print(f"{doc['size']} on {doc.get('device_name', device)}{' (CPU fallback)' if fallback else ''}:\n"
          f"  save() stall {s['save_stall']['median_s'] * 1e3:.1f} ms = {s['stall_vs_plain']:.2f}x a plain copy "
          f"({s['plain_d2h']['median_s'] * 1e3:.1f} ms)\n"
          f"  D2H {d['gb_per_s']:.1f} GB/s = {d['vs_limit']:.2f}x the {d['limit_gb_per_s']:.0f} GB/s limit\n"
          f"  step time with a save every {args.save_every}: {st['mean_vs_without']:.3f}x without (goal <= 1.05x)\n"
          f"  restore {r['restore']['median_s'] * 1e3:.1f} ms; a plain H2D copy is {r['plain_vs_restore']:.2f}x of it\n"
          f"  -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("LASTGOOD_LOG_LEVEL", "WARNING")
    sys.exit(main())
