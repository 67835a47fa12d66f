"""Data paths, torch-free: how one file's bytes reach the store and come back. The gRPC
transport (stream and spool), direct-FS, direct S3, and the rank's half of peer
verification, behind one interface for writes and reads (paths.DataPath) and one chooser
(choose.default_path)."""
