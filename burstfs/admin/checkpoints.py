"""``burstfs-admin latest`` and ``abandon``: checkpoints of the cross-node commit
(docs/SEMANTICS.md "Many nodes")."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from ..config import S3Options, parse_remote_url
from ..errors import BurstfsError, ConfigError
from ..mountinfo import find_burstfs_mount
from ..status import SCHEMA
from ..xattrs import LATEST_BELOW, LATEST_XATTR
from .common import (
    EXIT_ERROR,
    EXIT_UNKNOWN,
    EXIT_USAGE,
    AccessDenied,
    AdminError,
    Daemon,
    cache_option,
    emit_json,
    json_option,
    main,
    remote_of,
    resolve,
)

#: ``latest`` gives up on a remote that does not answer after this (its requests retry within it).
LATEST_TIMEOUT_S = 60.0


@main.command()
@click.argument("path", required=False, default=None)
@click.option(
    "--remote",
    "remote_url",
    default=None,
    help="Look at s3://BUCKET/PREFIX or file:///DIR directly (no mount); PATH is then a subdirectory.",
)
@click.option(
    "--endpoint-url",
    default=None,
    help="S3 endpoint (with --remote); default $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, the AWS config file or AWS.",
)
@click.option("--region", default=None, help="S3 region (with --remote).")
@cache_option
@json_option
def latest(
    path: str | None,
    remote_url: str | None,
    endpoint_url: str | None,
    region: str | None,
    cache: Path | None,
    as_json: bool,
) -> None:
    """The newest complete checkpoint directory under PATH (exit 1 if there is none).

    Complete: its commit marker was published by the cross-node commit, and every
    file its nodes' done records list is on the remote with the recorded size and
    digest.  Works from any node, and with --remote without a mount (a restart script).
    """
    found = latest_checkpoint(path, remote_url, endpoint_url, region, cache=cache)
    if as_json:
        emit_json({"schema": SCHEMA, **dataclasses.asdict(found)})
    else:
        for skipped in found.skipped:
            click.echo(f"skipped {skipped['dir'] or '/'}: {skipped['reason']}", err=True)
        if found.dir is not None:
            click.echo(found.path or "/")
        else:
            click.echo(f"no complete checkpoint under {found.subdir or '/'} in {found.remote}", err=True)
    if found.dir is None:
        sys.exit(EXIT_ERROR)


@dataclasses.dataclass
class Latest:
    """What ``latest`` found (``dir`` None: no complete checkpoint)."""

    remote: str
    subdir: str
    dir: str | None  # relative to the remote prefix
    step: str | None  # the directory holding its files: ``dir``, or the step a pointer there names
    path: str | None  # in the mount (the remote-relative dir with --remote)
    marker: str | None
    committed_at: float | None
    files: int
    skipped: list[dict[str, str]]  # newer checkpoints passed over: {"dir", "reason"}


def latest_checkpoint(
    path: str | os.PathLike[str] | None,
    remote_url: str | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    *,
    cache: Path | None = None,
) -> Latest:
    """The newest complete checkpoint under ``path`` (in a mount, or under the mount point a
    stopped ``cache`` was last mounted at), or under the subdirectory ``path`` of
    ``remote_url`` (no mount); see latest.find_latest."""
    import asyncio

    from ..latest import find_latest, missing_root
    from ..remote import open_remote

    try:
        if remote_url is not None and cache is not None:
            raise AdminError("give --remote or --cache, not both: --cache names a mount's remote", EXIT_USAGE)
        if remote_url is not None:
            url, s3 = parse_remote_url(remote_url), S3Options(endpoint_url=endpoint_url, region=region)
            subdir, root, daemon = str(path or "").strip("/"), None, None
            if path is not None and os.path.isabs(path) and os.path.exists(path):
                # A mount's (or any local) directory: its name on the remote is not that path, and
                # "none" from looking there would tell a restart script to start from scratch.
                raise AdminError(
                    f"{path} is a local path: with --remote, PATH is a subdirectory of the remote (like ckpt/run1); "
                    "or leave --remote out to ask the mount it is in",
                    EXIT_USAGE,
                )
            if any(part in (".", "..") for part in subdir.split("/")) or "//" in subdir:
                raise AdminError(
                    f"{path}: with --remote, PATH is a subdirectory of the remote (like ckpt/run1)", EXIT_USAGE
                )
        else:
            if path is None:
                raise AdminError("give a PATH inside a mount, or --remote URL", EXIT_USAGE)
            try:
                # Where on the remote to look: another node may have made it since this mount
                # listed its parent (ENOENT here said "no checkpoint", exit 1, for up to --list-ttl).
                target = resolve([Path(path)], cache, must_exist=False)
            except AccessDenied:  # a job's user under a mount root made: the daemon reads the remote
                return latest_through_mount(Path(path))
            with target.journal() as journal:
                url, s3 = remote_of(journal, target.cache_dir)
            s3 = dataclasses.replace(s3, endpoint_url=endpoint_url or s3.endpoint_url, region=region or s3.region)
            subdir, root, daemon = target.rels[0], target.mountpoint, target.daemon
        if url.scheme == "s3":
            s3.endpoint()  # a bad $AWS_ENDPOINT_URL, said as such (botocore raises a bare ValueError)
    except ConfigError as exc:
        raise AdminError(str(exc), EXIT_USAGE) from None
    missing = missing_root(url)
    if missing is not None:
        raise AdminError(missing, EXIT_UNKNOWN)

    async def look() -> Any:
        remote = open_remote(url, s3)
        try:
            async with asyncio.timeout(LATEST_TIMEOUT_S):
                return await find_latest(remote, subdir)
        finally:
            await remote.close()

    # Not exit 1 ("no complete checkpoint"): a restart script that starts over on it would
    # write over the checkpoint it could not see.
    try:
        found, skipped = asyncio.run(look())
    except TimeoutError:
        raise AdminError(f"{url}: the remote did not answer within {LATEST_TIMEOUT_S:.0f}s", EXIT_UNKNOWN) from None
    except BurstfsError as exc:
        raise AdminError(f"{url}: {exc}", EXIT_UNKNOWN) from None
    if found is not None and daemon is not None:
        _show(daemon, found.step)
    shown = None if found is None else str(root / found.dir) if root is not None else found.dir
    return Latest(
        remote=str(url),
        subdir=subdir,
        dir=found.dir if found else None,
        step=found.step if found else None,
        path=shown,
        marker=found.marker if found else None,
        committed_at=found.committed_at if found else None,
        files=found.files if found else 0,
        skipped=[{"dir": d, "reason": r} for d, r in skipped],
    )


def _show(daemon: Daemon, found: str) -> None:
    """Have the mount list ``found`` now: another node may have published it since this mount
    listed its parent, and the restart that opens it next must not get ENOENT for up to
    ``--list-ttl``.  Best effort: the answer stands without it."""
    try:
        daemon.call("refresh_listings", paths=[found])
    except AdminError as exc:
        click.echo(f"warning: {found} may not show in the mount until its next listing: {exc.message}", err=True)


def latest_through_mount(path: Path) -> Latest:
    """``latest`` of a directory in a mount this user may not administer (no control socket,
    no journal): its ``user.burstfs.latest``, which the daemon answers from the remote."""
    found = find_burstfs_mount(path)
    if found is None:
        raise AdminError(f"{path} is not inside a burstfs mount", EXIT_USAGE)
    mountpoint = found[0]
    # A directory another node made since this mount listed its parent is not here yet: its
    # nearest ancestor here asks for it by name (user.burstfs.latest/SUB), the remote answers.
    asked, below = Path(path), list[str]()  # as given: a relative path needs no look above the mount
    while not os.path.lexists(asked) and mountpoint in Path(os.path.abspath(asked)).parents:
        below.insert(0, asked.name)
        asked = asked.parent
    name = (LATEST_BELOW + os.fsencode("/".join(below))) if below else LATEST_XATTR
    try:
        doc = json.loads(os.getxattr(asked, name.decode(errors="surrogateescape")))
    except OSError as exc:
        problem = os.strerror(exc.errno) if exc.errno else str(exc)
        raise AdminError(
            f"{path}: the mount cannot say which checkpoint is the newest ({problem})", EXIT_UNKNOWN
        ) from None
    except ValueError as exc:
        raise AdminError(f"{path}: the mount's answer is not JSON ({exc})", EXIT_UNKNOWN) from None
    subdir = os.path.relpath(os.path.realpath(path), mountpoint)
    return Latest(
        remote=doc["remote"],
        subdir="" if subdir == "." else subdir,
        dir=doc["dir"],
        step=doc.get("step", doc["dir"]),
        path=None if doc["dir"] is None else str(mountpoint / doc["dir"]),
        marker=doc["marker"],
        committed_at=doc["committed_at"],
        files=doc["files"],
        skipped=doc["skipped"],
    )


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--yes", is_flag=True, help="Confirm: the checkpoint in PATH is given up for good.")
@cache_option
@json_option
def abandon(path: Path, yes: bool, cache: Path | None, as_json: bool) -> None:
    """Give up the checkpoint in directory PATH whose marker waits for a lost node.

    Its marker (held on this node) is never published; the lost nodes' intents no
    longer hold later checkpoints written into PATH.  Run it on the node that
    holds the marker (burstfs-admin status shows "waiting for node ...").
    """
    if not yes:
        raise AdminError(f"abandon gives up the checkpoint in {path} for good: add --yes", EXIT_USAGE)
    target = resolve([path], cache)
    doc = target.need_daemon("abandon").call("abandon", paths=target.rels)
    if as_json:
        emit_json(doc)
        return
    nodes = ", ".join(sorted({w["node"] for w in doc["gave_up"]})) or "none"
    click.echo(f"abandoned the checkpoint in {doc['dir'] or '/'} (gave up on nodes: {nodes})")
