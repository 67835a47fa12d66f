"""One rule for byte counts (lastgood.common.sizes), read alike by the client's settings,
the export's --max-shard-size and the benches: K/M/G/T and KiB... binary, KB/MB/GB/TB
decimal, as Hugging Face counts."""

from __future__ import annotations

import pytest

from lastgood.common.sizes import parse_size
from lastgood.export.hf import shard_size
from lastgood.remote.config import ClientConfig


@pytest.mark.parametrize("text,n", [("1000", 1000), ("1000B", 1000), ("256K", 256 << 10), ("256M", 256 << 20),
                                    ("1G", 1 << 30), ("2T", 2 << 40), ("500MiB", 500 << 20), ("1.5G", 3 << 29),
                                    ("5KB", 5000), ("5MB", 5 * 10**6), ("5GB", 5 * 10**9), (" 1 tb ", 10**12),
                                    ("0", 0), (7, 7)])
def test_one_rule_for_every_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "G", "5 parsecs", "-1GB", "1e9", "5MBs", -1, "9" * 16])
def test_anything_else_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_the_settings_and_the_export_read_sizes_alike():
    """LASTGOOD_FILE_BYTES and the export's shard size take the same words with the same
    meaning: "256MB" is decimal in both, "256M" binary in both."""
    for text in ("256MB", "256M", "1GiB"):
        assert ClientConfig.resolve(env={"LASTGOOD_FILE_BYTES": text}).file_bytes == shard_size(text) == parse_size(text)
    with pytest.raises(ValueError, match="LASTGOOD_FILE_BYTES"):
        ClientConfig.resolve(env={"LASTGOOD_FILE_BYTES": "lots"})
