"""The catalog: runs, checkpoints, shards, votes, tags and events in one SQL database."""
