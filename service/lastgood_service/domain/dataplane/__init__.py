"""The data paths beside the stream a file's bytes can take into the store, and out:

  spool.py     the same-host hand-over: a file written into the spool directory, taken by name
  directfs.py  direct-FS: ranks write into the local store's own file system, from any host
  grants.py    direct S3 uploads and reads: presigned URLs, the store carries the bytes

Each ends in the commit's put of a file (domain/commit/put.py), whose checks every path
makes; which of them hashes the bytes is the verification mode's (domain/peer).
"""
