"""Thin transports: REST (FastAPI) and gRPC call the same domain functions."""
