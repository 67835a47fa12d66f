"""xxh3-128, the one content hash of lastgood (client and service use this module).

Why xxh3-128: it hashes at memory speed (well above disk and network), so hashing every
byte end to end costs little; 128 bits make accidental collisions irrelevant. It is not a
cryptographic hash: it detects corruption, it does not authenticate.
"""

from __future__ import annotations

import xxhash

HEX_LEN = 32


class StreamHasher:
    """Incremental xxh3-128 over a stream of buffers (bytes, memoryview, numpy, ...)."""

    __slots__ = ("_h", "size")

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()
        self.size = 0

    def update(self, data) -> None:
        mv = memoryview(data)
        self._h.update(mv)
        self.size += mv.nbytes

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def digest(self) -> bytes:
        """The 16 raw bytes hexdigest() spells (for tables of many digests)."""
        return self._h.digest()


def hash_bytes(data) -> str:
    """xxh3-128 of one buffer, as 32 lowercase hex digits."""
    return xxhash.xxh3_128_hexdigest(memoryview(data))


def is_valid_hex(value: str) -> bool:
    return (
        isinstance(value, str)
        and len(value) == HEX_LEN
        and all(c in "0123456789abcdef" for c in value)
    )
