"""Talking to the service, torch-free: the client's settings (config), the one retry policy
(retry), the REST client (rest) and the heartbeat thread (heartbeat)."""
