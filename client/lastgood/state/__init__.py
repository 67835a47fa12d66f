"""State capture: what a bit-exact resume needs, as tensors plus typed JSON (TrainState),
the shard file's planning and parallel I/O, snapshots into staging buffers, and the
loaders, samplers and RNGs a training step draws from.

`lastgood.state.TrainState` is the public path; it is imported on first use, so the
torch-free modules of this package (split) can be used without torch.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "TrainState":
        from lastgood.state.trainstate import TrainState

        return TrainState
    raise AttributeError(f"module 'lastgood.state' has no attribute {name!r}")
