"""What the catalog holds of a run beyond the commit of one checkpoint:

  fencing.py        launches and their generations: writes of an older launch are refused
  lineage.py        the checkpoints' tree: parents, branches, ancestors and descendants
  branches.py       the branch stored with each checkpoint, settled as checkpoints begin and commit
  last_good.py      the last-good pointer, its one owner (advance, retreat, roll back)
  curation.py       tags, aliases, pins, suspects, rollbacks and read leases
  retention.py      retention policies: what of a run GC keeps
  run_retention.py  a run's own retention policy, set through the API

The commit (domain/commit) builds on these; nothing here knows of the commit.
"""
