"""One rank's side of the two-phase commit, for every writer (the Checkpointer, DCP's
StorageWriter): begin, send, vote, the outcome, the lost-reply check, abort (session)."""
