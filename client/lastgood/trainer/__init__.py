"""The trainer-facing API: the Checkpointer (save, restore, wait, close), its queue of
uploads, and the SpikeGuard."""
