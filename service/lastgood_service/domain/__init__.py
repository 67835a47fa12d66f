"""Domain logic shared by the REST and gRPC transports: no HTTP or gRPC types here."""
