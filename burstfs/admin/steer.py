"""``burstfs-admin drain``, ``retry``, ``evict``, ``prefetch`` and ``verify``: steering a
mount's drain and its local tier (``verify`` also works on a stopped mount)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import BurstfsError
from ..progress import Progress, count, fmt_bytes
from ..verify import verify_stopped
from .common import (
    EXIT_ERROR,
    EXIT_FAILED,
    AdminError,
    emit_json,
    path_command,
    remote_of,
    resolve,
    shown,
)


@path_command()
@click.option("--now", is_flag=True, help="Skip the configured drain delay and any retry backoff.")
def drain(path: Path, cache: Path | None, as_json: bool, now: bool) -> None:
    """Start draining at once (--now)."""
    if not now:
        raise click.UsageError(
            "say --now to drain at once; to block until files are durable, use: burstfs-admin wait PATH"
        )
    target = resolve([path], cache)
    daemon = target.need_daemon(
        "drain --now", f"drain a stopped mount's cache with: burstfs drain --cache {target.cache_dir}"
    )
    doc = daemon.call("drain_now")
    emit_json(doc) if as_json else click.echo("draining now (delays and retry backoff skipped)")


@path_command()
def retry(path: Path, cache: Path | None, as_json: bool) -> None:
    """Requeue failed files and lift a halted drain."""
    target = resolve([path], cache)
    doc = target.need_daemon("retry").call("retry")
    emit_json(doc) if as_json else click.echo(f"requeued {doc['requeued']} failed files")


def _per_file_failures(doc: dict[str, Any], verb: str) -> None:
    failed = [f for f in doc["files"] if not f["ok"]]
    if failed:
        raise AdminError(f"{len(failed)} of {len(doc['files'])} files not {verb}")


@path_command(many=True)
def evict(paths: tuple[Path, ...], cache: Path | None, as_json: bool) -> None:
    """Drop the local copies of durable files (they are fetched again when read)."""
    target = resolve(paths, cache)
    doc = target.need_daemon("evict").call("evict", paths=target.rels)
    if as_json:
        emit_json(doc)
    else:
        for f in doc["files"]:
            click.echo(
                f"evicted {shown(f['path'])} ({fmt_bytes(f['bytes_freed'])})"
                if f["ok"]
                else shown(f"not evicted {f['path']}: {f['error']}")
            )
        click.echo(f"freed {fmt_bytes(doc['bytes_freed'])}")
    _per_file_failures(doc, "evicted")


@path_command(many=True)
def prefetch(paths: tuple[Path, ...], cache: Path | None, as_json: bool) -> None:
    """Fetch files that are only on the remote to the local tier, with progress."""
    target = resolve(paths, cache)
    daemon = target.need_daemon("prefetch")
    bar = None if as_json else Progress("fetched", baseline=0, bytes_in_flight=True)

    def progress(message: dict[str, Any]) -> None:
        file = message["file"]  # None: bytes landed so far, between files
        what = None
        if file is not None:
            what = shown(f"fetched {file['path']}" if file["ok"] else f"failed {file['path']}: {file['error']}")
        if bar is not None:
            bar.update(
                message["done_files"], message["total_files"], message["done_bytes"], message["total_bytes"], what
            )

    try:
        doc = daemon.call("prefetch", paths=target.rels, timeout=None, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        emit_json(doc)
    else:
        failed = sum(not f["ok"] for f in doc["files"])
        click.echo(
            f"fetched {fmt_bytes(doc['bytes'])} in {count(len(doc['files']) - failed, 'file')}"
            + (f"; {failed} failed" if failed else "")
        )
    evicted = doc.get("evicted_again", [])  # absent from an older daemon's answer
    if evicted:  # on stderr with --json too: a script may log stderr and parse only stdout
        click.echo(
            f"burstfs-admin: warning: the local tier could not hold all of it: {len(evicted)} of the files "
            f"fetched were evicted again to make room for the others (first: {shown(evicted[0])}); their "
            "reads fetch them anew (raise --cache-size to keep a checkpoint this large local)",
            err=True,
        )
    _per_file_failures(doc, "fetched")


@path_command(name="verify", many=True)
@click.option("--remote", "check_remote", is_flag=True, help="Also read each object back from the remote.")
def verify_command(paths: tuple[Path, ...], cache: Path | None, as_json: bool, check_remote: bool) -> None:
    """Re-hash files against the digests journaled at close (exit 4 on a mismatch)."""
    target = resolve(paths, cache)
    if target.daemon is not None:
        doc = target.daemon.call("verify", paths=target.rels, remote=check_remote, timeout=None)
    else:
        with target.journal() as journal:
            remote, s3 = remote_of(journal, target.cache_dir) if check_remote else (None, None)
            try:
                doc = verify_stopped(target.cache_dir, journal, target.rels, remote, s3)
            except BurstfsError as exc:
                raise AdminError(str(exc)) from None
    if as_json:
        emit_json(doc)
    else:
        for f in doc["files"]:
            checks = "; ".join(f"{name}: {f[name]['detail']}" for name in ("local", "remote") if name in f)
            click.echo(f"{f['result']:<8}  {shown(f['path'])}  ({shown(checks)})")
    if doc["mismatches"]:
        raise AdminError(f"{doc['mismatches']} of {len(doc['files'])} files do not match their checksums", EXIT_FAILED)
    skipped = sum(f["result"] == "SKIPPED" for f in doc["files"])  # an older daemon's document has no "skipped"
    if skipped:  # nothing was checked for them: never a success
        raise AdminError(
            f"{skipped} of {len(doc['files'])} files could not be checked (SKIPPED); "
            "verify them once they are closed, hashed or drained",
            EXIT_ERROR,
        )
