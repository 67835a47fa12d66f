"""Every random number generator a training step can draw from.

Captured without being asked: Python `random`, NumPy's global generator, torch's CPU
generator, and torch CUDA's generator on every device. Named `torch.Generator`s passed to
TrainState are captured by TrainState itself.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from lastgood.errors import LastgoodError


def capture() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def check(state: dict) -> None:
    cuda = state.get("cuda")
    if cuda:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have != len(cuda):
            raise LastgoodError(f"checkpoint holds CUDA RNG states of {len(cuda)} devices; this process sees {have}")


def restore(state: dict) -> None:
    check(state)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    for i, s in enumerate(state.get("cuda") or ()):
        torch.cuda.set_rng_state(s, i)


def seed_all(seed: int) -> None:
    """Seed every generator from one number (a rank that has no saved streams)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # CPU and every CUDA device
