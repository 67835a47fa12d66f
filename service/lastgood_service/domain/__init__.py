"""Domain logic shared by the REST and gRPC transports: no HTTP or gRPC types here.

Floors, each importing only the ones below it (.importlinter, domain-layers):

  gc.py, repair.py, queries.py  catalog-wide passes and reads: GC, fsck and rebuild, the API's queries
  dataplane/                    the data paths beside the stream: spool, direct-FS, direct S3 grants
  peer/                         who verifies bytes handed over by name; peer checks and their fallback
  commit/                       the two-phase commit of a checkpoint, its values, reads and outcomes
  health/                       run health: heartbeats, verdicts, the checkpoint interval
  runs/                         a run's launches, lineage, branches, last-good, curation, retention
  tokens.py                     API tokens and their roles
  faults.py, gate.py, events.py, keys.py, errors.py
                                what every floor shares: storage faults, the catalog gate, events,
                                blob keys, the domain's errors
"""
