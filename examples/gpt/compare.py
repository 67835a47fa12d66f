"""Compare two runs of train.py bit for bit: per-step losses and sample ids, final
parameters, optimizer state and RNG states. Used by `make demo` and the tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def load_steps(path: Path) -> tuple[dict[int, dict], list[int]]:
    """step -> the last record written for it; and the steps that were written twice
    (the ones a resumed run trained again after its restore point)."""
    steps: dict[int, dict] = {}
    repeated = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] in steps:
            repeated.append(rec["step"])
        steps[rec["step"]] = rec
    return steps, repeated


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def compare(ref: Path, other: Path, world: int) -> list[str]:
    """Every difference between the two runs, as readable lines; empty means identical."""
    diffs = []
    for rank in range(world):
        a, _ = load_steps(ref / f"losses-rank{rank}.jsonl")
        b, _ = load_steps(other / f"losses-rank{rank}.jsonl")
        if sorted(a) != sorted(b):
            diffs.append(f"rank {rank}: steps {sorted(set(a) ^ set(b))} logged by only one run")
        for s in sorted(set(a) & set(b)):
            for key in ("loss", "ids", "epoch"):
                if a[s][key] != b[s][key]:
                    diffs.append(f"rank {rank} step {s}: {key} {a[s][key]} != {b[s][key]}")
    return diffs + compare_final(ref, other, world)


def compare_final(ref: Path, other: Path, world: int) -> list[str]:
    """The differences between the final states alone (parameters, optimizer, RNGs)."""
    diffs = []
    for rank in range(world):
        ta, tb = _tensors(ref / f"final-rank{rank}.safetensors"), _tensors(other / f"final-rank{rank}.safetensors")
        if set(ta) != set(tb):
            diffs.append(f"rank {rank}: final tensors differ in names")
        for k in sorted(set(ta) & set(tb)):
            if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or not torch.equal(ta[k], tb[k]):
                diffs.append(f"rank {rank}: final {k} differs")
        ja = json.loads((ref / f"final-rank{rank}.json").read_text())
        jb = json.loads((other / f"final-rank{rank}.json").read_text())
        for k in sorted(set(ja) | set(jb)):
            if ja.get(k) != jb.get(k):
                diffs.append(f"rank {rank}: final {k} differs")
    return diffs


if __name__ == "__main__":
    d = compare(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    print("\n".join(d) if d else "IDENTICAL")
    sys.exit(1 if d else 0)
