"""The errors the contract itself raises: torch-free, and the roots of lastgood.errors."""

from __future__ import annotations


class LastgoodError(Exception):
    """Base class of every error lastgood raises on purpose."""


class FormatError(LastgoodError):
    """A shard file is not a valid lastgood safetensors file."""
