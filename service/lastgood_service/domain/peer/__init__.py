"""Who verifies the bytes of a file handed over by name, and peer verification:

  verification_modes.py  the modes (service, peer, store), the start-up check of the one
                         configured, and PeerChecks: a rank's assignment and its report
  peer_fallback.py       the liveness rule: the service hashes, and commits, what no peer checked

Both build on the commit (domain/commit); the composition root (main.py) builds the one
PeerFallback and PeerChecks of a process.
"""
