"""The memory tier's catalog side (docs/memory-tier.md, "In the catalog"):

  agents.py   node agents: registration (a key, stored as its SHA-256), the placement list,
              the key check every agent call makes
  copies.py   agents' copy reports (which verify memory files: commit/tiering.py), the copies
              of a committed memory checkpoint, the segments an agent must keep (live)

The rule that makes a memory file VERIFIED is the commit's (domain/commit/tiering.py).
"""
