"""The S3 part rule both sides apply to a direct upload (docs/direct-s3.md): how a file is
cut into multipart parts, and how each part's CRC32 is spelled for the store to check."""

from __future__ import annotations

import base64
import math

MAX_PARTS = 10_000                    # S3's limit
MIN_PART_SIZE = 5 * 1024 * 1024       # S3's limits on a part (but the last)
MAX_PART_SIZE = 5 * 1024 * 1024 * 1024
# the header that carries a part's CRC32; the grant signs it, so a URL admits one content
CHECKSUM_HEADER = "x-amz-checksum-crc32"


def part_layout(size: int, base: int) -> tuple[int, int]:
    """(part size, number of parts) of a file of `size` bytes: parts of `base` bytes, grown
    to fit S3's 10,000 parts; the last part holds the rest (an empty file: one empty part)."""
    part = max(base, math.ceil(size / MAX_PARTS))
    return part, max(1, math.ceil(size / part))


def crc32_b64(crc: int) -> str:
    """A CRC32 as S3 spells it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()
