"""Restore at any world size: the read plan (each rank reads only the byte ranges it needs,
verified) and the lookup of replicated pieces another rank wrote."""
