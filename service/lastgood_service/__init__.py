"""lastgood service: two-phase-commit checkpoint store (REST + gRPC in one process)."""

__version__ = "0.1.0"
