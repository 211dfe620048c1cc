"""Hard links: one inode, several names, one remote object per name.

The remote has no links, so every name of a file drains as its own object (the
same bytes under each key).  The journal keeps the inode's own row (its first
name, attributes, data file) and one row per extra name (``link_of`` = the
inode): each name row has its own parent, name, drain state, ``remote_key`` and
``upload_key``, so the mover's key-ownership protocol (claims, relocations, stale
keys, the delete queue) works per name unchanged, while what the bytes are
(state ``writing``, generation, digests) is journaled for all names at once
(``journal.update_file_op``).  The inode's own row stays, without a name
(``parent = 0``), while extra names outlive its first one.

In memory an :class:`~burstfs.nodes.Inode` keeps its first name in
``parent``/``name`` as before and its extra names in ``links``; directories map
every name to the inode's number (the kernel sees one inode, ``st_nlink`` names).
"""

from __future__ import annotations

from .nodes import Inode, Undo


def name_row(inode: Inode, parent: int, name: bytes) -> int:
    """The journal row of ``inode``'s name ``name`` in ``parent``: the inode's own or a link's."""
    if inode.parent == parent and inode.name == name:
        return inode.ino
    for row, (link_parent, link_name) in inode.links.items():
        if link_parent == parent and link_name == name:
            return row
    raise AssertionError(f"inode {inode.ino} has no name {name!r} in {parent}")


def add_name(parent: Inode, inode: Inode, row: int, name: bytes, undo: Undo) -> None:
    """``inode`` gets the extra name ``name`` in ``parent`` (row ``row``); ``undo`` takes it back."""
    assert parent.children is not None
    parent.children[name] = inode.ino
    inode.links[row] = (parent.ino, name)

    def remove() -> None:
        if parent.children is not None and parent.children.get(name) == inode.ino:
            del parent.children[name]
        inode.links.pop(row, None)

    undo.add(remove)


def drop_name(parent: Inode, inode: Inode, row: int, undo: Undo) -> bytes:
    """``inode`` loses its extra name ``row`` (in ``parent``); ``undo`` gives it back.  Returns the name."""
    assert parent.children is not None
    _, name = inode.links.pop(row)
    del parent.children[name]

    def restore() -> None:
        assert parent.children is not None
        parent.children[name] = inode.ino
        inode.links[row] = (parent.ino, name)

    undo.add(restore)
    return name
