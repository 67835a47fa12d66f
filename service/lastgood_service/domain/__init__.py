"""Domain logic shared by the REST and gRPC transports: no HTTP or gRPC types here.

Floors, top to bottom; each imports only the floors below it, and the parts of one floor
(a | b) do not import each other (.importlinter, domain-layers):

  gc/ | repair.py | queries.py   catalog-wide passes and reads: GC, fsck and rebuild, the API's queries
  dataplane/                     the data paths beside the stream: spool, direct-FS, direct S3 grants
  peer/ | memory/                who verifies bytes handed over by name; peer checks and their fallback;
                                 the memory tier's node agents and their copy reports
  commit/ | health/              the two-phase commit of a checkpoint, its values, reads and outcomes;
                                 run health: heartbeats, verdicts, the checkpoint interval
  runs/                          a run's launches, lineage, branches, last-good, curation, retention
  tokens.py | faults.py | gate.py | events.py | keys.py
                                 API tokens and roles, storage faults, the catalog gate, events, blob keys
  errors.py                      the domain's errors
"""
