"""Byte counts as people write them: the one rule for every setting, option and bench flag.

    1000, 1000B     bytes
    256K, 256M, 1G, 2T and KiB, MiB, GiB, TiB     binary: 2^10, 2^20, 2^30, 2^40
    5KB, 5MB, 5GB, 5TB                            decimal (SI, as Hugging Face counts): 10^3 ... 10^12

A fraction is allowed where it comes to whole bytes' worth ("1.5G"); case does not matter.
"""

from __future__ import annotations

import re

UNITS = {"": 1, "B": 1,
         "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
         "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE = re.compile(r"\s*(\d{1,15}(?:\.\d{1,9})?)\s*([A-Za-z]{0,3})\s*")


def parse_size(text: str | int) -> int:
    """The byte count `text` says (>= 0); ValueError says what is wrong with anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in UNITS:
        raise ValueError(f"{str(text)[:40]!r} is not a size: a number with an optional unit "
                         f"(B; K, M, G, T or KiB ... TiB: binary; KB, MB, GB, TB: decimal), e.g. 256M or 5GB")
    return int(float(m.group(1)) * UNITS[unit])
