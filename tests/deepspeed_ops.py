"""DeepSpeed's CPU accelerator compiles two C++ ops the first time a process needs them:
`deepspeed_shm_comm` (at init_distributed) and `fused_adam` (an "AdamW" optimizer in the
config). On two loaded cores that takes minutes, every torchrun rank of a test waits on it
behind torch's lock file, and a build killed by a test's timeout leaves that lock behind,
so every later DeepSpeed process hangs on it.

So the ops are built once, at install (`make test`'s dev stamp runs this module), into a
directory beside the virtual environment's packages; tests/conftest.py points every test
process at it. This module owns the directory."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# the environment torch reads its JIT-extension build directory from (torch.utils.cpp_extension)
ENV = "TORCH_EXTENSIONS_DIR"
DIR = Path(sys.prefix) / "torch-extensions"
OPS = ("ShareMemCommBuilder", "FusedAdamBuilder")


def use() -> None:
    """Point this process and its children at the prebuilt ops (an explicit setting wins)."""
    os.environ.setdefault(ENV, str(DIR))


def build() -> None:
    use()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    for name in OPS:
        t = time.monotonic()
        get_accelerator().create_op_builder(name).load()
        print(f"deepspeed op {name}: ready in {time.monotonic() - t:.0f} s ({os.environ[ENV]})", flush=True)


if __name__ == "__main__":
    build()
