"""Torch-free helpers that are not protocol: durable file-system steps (durable), the
Young/Daly checkpoint-interval math (interval), the one rule for byte counts (sizes), and
a rank's pool of file threads (parallel). Imports nothing else of lastgood but the wire."""
