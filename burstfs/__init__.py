"""burstfs: a FUSE burst buffer for AI training checkpoints."""

from .config import DrainOptions, MountConfig, RemoteURL, S3Options, parse_remote_url
from .errors import BurstfsError, ConfigError, CorruptDataError, NoSpaceError, RemoteError

__all__ = [
    "BurstfsError",
    "ConfigError",
    "CorruptDataError",
    "DrainOptions",
    "MountConfig",
    "NoSpaceError",
    "RemoteError",
    "RemoteURL",
    "S3Options",
    "parse_remote_url",
]
__version__ = "0.1.0"
