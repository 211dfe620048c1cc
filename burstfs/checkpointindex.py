"""What a checkpoint's index names: the data files a framework reads back through it.

PyTorch DCP's ``.metadata`` (a pickle) and a Hugging Face ``*.index.json`` (its
``weight_map``) name the files of their checkpoint.  Read plans fetch those ahead
(``readplans.py``); the marker gate waits until each is in some node's done record
(``commitgroups.py``).  Nothing here unpickles: the index may be another node's, read
from the remote, and a pickle runs code.
"""

from __future__ import annotations

import json
import os
import re
import struct

MAX_INDEX_BYTES = 16 << 20  # a bigger weight_map index is not one: it is not read
#: A DCP ``.metadata`` of a checkpoint of thousands of ranks is tens of MiB; a bigger one is
#: not scanned for the files it names.
MAX_DCP_METADATA_BYTES = 256 << 20

# A data file's name as torch's FileSystemWriter makes it (``__RANK_N.distcp``), stored in the
# pickle as a string: SHORT_BINUNICODE (0x8c, a length byte) or BINUNICODE ('X', 4 length
# bytes, little-endian).  The length is checked, so a longer name ending the same way is not
# taken for it.
_DCP_NAME = rb"(__\d+_\d+\.distcp)"
_SHORT_STRING = re.compile(rb"\x8c(.)" + _DCP_NAME, re.DOTALL)
_STRING = re.compile(rb"X(.{4})" + _DCP_NAME, re.DOTALL)


def index_kind(name: bytes) -> str | None:
    """What kind of checkpoint index a file of this name is (None: not one)."""
    if name == b".metadata":
        return "dcp"
    if name.endswith(b".index.json"):
        return "weight_map"
    return None


def weight_map_files(data: bytes) -> list[bytes]:
    """The files a Hugging Face ``*.index.json`` maps tensors to, in its order (each once).
    Names with a path separator are not followed."""
    try:
        weight_map = json.loads(data).get("weight_map")
    except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, nested too deep
        return []
    if not isinstance(weight_map, dict):
        return []
    names = (value for value in weight_map.values() if isinstance(value, str))
    plain = (os.fsencode(name) for name in names if name and "/" not in name and name not in (".", ".."))
    return list(dict.fromkeys(plain))


def dcp_metadata_files(data: bytes) -> list[bytes]:
    """The data files a DCP ``.metadata`` names (as torch's FileSystemWriter names them), in
    the order found, each once; read from the pickle's bytes, not unpickled.  A custom
    writer's names are not recognized: then it names none here."""
    found = [m.group(2) for m in _SHORT_STRING.finditer(data) if m.group(1)[0] == len(m.group(2))]
    found += [m.group(2) for m in _STRING.finditer(data) if struct.unpack("<I", m.group(1))[0] == len(m.group(2))]
    return list(dict.fromkeys(found))


def named_files(name: bytes, data: bytes) -> list[bytes]:
    """The files the index called ``name`` with content ``data`` names (none if it is no index)."""
    kind = index_kind(name)
    if kind == "dcp":
        return dcp_metadata_files(data)
    if kind == "weight_map":
        return weight_map_files(data)
    return []


def read_index(path: os.PathLike[str] | str, name: bytes) -> bytes:
    """The content of the index called ``name`` at ``path`` (blocking), or nothing if it is
    bigger than an index of its kind can be."""
    limit = MAX_DCP_METADATA_BYTES if index_kind(name) == "dcp" else MAX_INDEX_BYTES
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return b"" if len(data) > limit else data
