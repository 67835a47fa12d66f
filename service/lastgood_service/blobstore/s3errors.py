"""What an S3 error means to lastgood, one place for the store (s3.py) and its direct
access (s3direct.py), which both read objects and must agree on "there is none"."""

from __future__ import annotations

from minio.error import S3Error


def not_found(e: S3Error) -> bool:
    """Does the error say the object is not there (rather than that the call failed)?"""
    return e.code in ("NoSuchKey", "NoSuchObject")
