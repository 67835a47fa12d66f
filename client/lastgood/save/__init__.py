"""The save path shared by every writer: the session (the commit protocol, one rank's side)
and the data paths (how a file's bytes reach the store). See session.py and paths.py."""

from .paths import DataPath, Prepared, SpoolPath, StreamPath, default_path
from .session import SaveSession, Unsure, Upload

__all__ = ["DataPath", "Prepared", "SaveSession", "SpoolPath", "StreamPath", "Unsure", "Upload", "default_path"]
