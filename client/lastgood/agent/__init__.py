"""The node agent of the memory tier (docs/memory-tier.md): one process per node that holds
the node's memory checkpoints in shared memory, hashes them, replicates them to partner
agents and serves ranged reads for restores. Torch-free (.importlinter)."""
