"""``burstfs-admin``: see and steer the drain of a burstfs mount.

PATH is a mount point or anything inside it.  A live mount is asked through its
control socket (``CACHE/control.sock``); a stopped one is read from its journal,
read-only, when PATH or ``--cache DIR`` names its cache dir.  Human tables by
default, ``--json`` documents (docs/ADMIN.md) for scripts.

Exit codes: 0 ok, 1 error (latest: no complete checkpoint), 2 bad usage (or
nothing to talk to), 3 timeout, 4 a file failed to drain or did not verify,
5 latest could not read the remote.
"""

from . import checkpoints, steer, views  # noqa: F401  (each registers its commands on ``main``)
from .common import main

__all__ = ["main"]
