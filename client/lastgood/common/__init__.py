"""Torch-free helpers both sides use that are not protocol: durable file-system steps
(durable) and the Young/Daly checkpoint-interval math (interval). Imports nothing else of
lastgood but the wire."""
