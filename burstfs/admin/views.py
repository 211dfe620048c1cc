"""``burstfs-admin status``, ``ls``, ``wait`` and ``journal``: what a mount holds and how
its drain goes, from the daemon when one runs, else read-only from the journal."""

from __future__ import annotations

import datetime
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from ..cachelock import CacheLock
from ..journal import FILE_STATES, QUEUED
from ..progress import Progress, count, fmt_bytes, fmt_duration
from ..status import (
    SCHEMA,
    Durability,
    journal_events,
    journal_status,
    list_files,
    short_reason,
    wait_state,
)
from .common import (
    EXIT_FAILED,
    EXIT_TIMEOUT,
    AdminError,
    DaemonLost,
    Target,
    emit_json,
    fmt_time,
    journal_call,
    outage_line,
    outage_note,
    path_command,
    remote_left_note,
    resolve,
    seconds_option,
    shown,
    table,
    wait_durable,
)

WATCH_INTERVAL_S = 1.0


#: A daemon that does not answer status this fast (stopped, hung) is left out: the journal answers.
STATUS_ANSWER_S = 10.0


def _status_doc(target: Target) -> dict[str, Any]:
    if target.daemon is not None:
        try:
            return target.daemon.call("status", timeout=STATUS_ANSWER_S)
        except DaemonLost as exc:
            click.echo(f"warning: {exc} (stopped or hung?); showing the journal", err=True)
    pid = CacheLock(target.cache_dir).owner_pid()
    doc = journal_call(target, journal_status, target.cache_dir, pid is not None)
    doc["pid"] = pid
    return doc


def _print_status(doc: dict[str, Any]) -> None:
    if doc["live"]:
        click.echo(f"burstfs at {doc['mountpoint']} (running, pid {doc['pid']})")
    else:
        owner = f"; pid {doc['pid']} holds the cache (burstfs drain?)" if doc["pid"] else ""
        click.echo(f"burstfs cache {doc['cache_dir']}: not mounted (last at {doc['mountpoint'] or '-'}){owner}")
    click.echo(f"  cache {doc['cache_dir']}   remote {doc['remote']}")
    if doc["data_path"] == "passthrough":
        click.echo("  data path: FUSE passthrough (the kernel reads and writes local files on the tier)")
    elif doc["data_path"]:
        click.echo("  data path: through the daemon (see burstfs.log for why passthrough is off)")
    states = doc["states"]
    rows = [[s, str(states[s]["files"]), fmt_bytes(states[s]["bytes"])] for s in FILE_STATES]
    click.echo(table(["STATE", "FILES", "BYTES"], rows, right=(1, 2)))
    undrained = doc["undrained"]
    oldest = f"; oldest closed {fmt_duration(undrained['oldest_age_s'])} ago" if undrained["files"] else ""
    click.echo(f"undrained: {count(undrained['files'], 'file')}, {fmt_bytes(undrained['bytes'])}{oldest}")
    work = doc.get("remote_work")  # absent from an older daemon's document
    if work and (work["moving"] or work["deletes"] or work.get("records")):
        records = f", {count(work['records'], 'record')} of this node to go out" if work.get("records") else ""
        click.echo(f"remote: {work['moving']} objects to move after renames, {work['deletes']} deletes queued{records}")
    drain = doc["drain"]
    outage = drain.get("outage")  # absent from an older daemon's document
    if outage:
        click.echo(outage_line(outage))
    if doc["live"]:
        queued = any(states[s]["files"] for s in QUEUED)  # ETA 0 with files queued: their last requests
        eta = "nothing to drain" if drain["eta_s"] == 0 and not queued else f"ETA {fmt_duration(drain['eta_s'])}"
        click.echo(
            f"drain: {fmt_bytes(drain['throughput_bps'])}/s, {eta}; "
            f"{count(drain['files_drained'], 'file')} ({fmt_bytes(drain['bytes_drained'])}) drained since mount"
        )
    if doc.get("node_id"):
        click.echo(f"node id: {doc['node_id']}")
    for held in doc.get("checkpoints_waiting", ()):
        click.echo(_held_line(held))
    if drain["halted"]:
        hint = "fix the remote: the drain looks again every 15 s, burstfs-admin retry PATH at once"
        click.echo(f"HALTED: {drain['halted']}  ({hint})")
    if drain["mover_crashed"]:
        click.echo(f"MOVER CRASHED: {drain['mover_crashed']}  (see {doc['cache_dir']}/burstfs.log)")
    if drain["errors_by_kind"]:
        click.echo("errors: " + ", ".join(f"{k}={v}" for k, v in sorted(drain["errors_by_kind"].items())))
        for error in drain["recent_errors"][-5:]:
            click.echo(f"  {fmt_time(error['time'])}  {short_reason(error['message'])}")
    tier = doc["local_tier"]
    line = f"local tier {tier['path']}: burstfs holds {fmt_bytes(tier['used_bytes'])}"
    if tier["fs_total_bytes"] is not None:
        line += f"; file system {fmt_bytes(tier['fs_total_bytes'])}, {fmt_bytes(tier['fs_free_bytes'])} free"
    if tier["mount_total_bytes"] is not None:
        line += f"; mount reports {fmt_bytes(tier['mount_free_bytes'])} free of {fmt_bytes(tier['mount_total_bytes'])}"
    if tier["limit_bytes"] is not None:
        line += f"; limit {fmt_bytes(tier['limit_bytes'])}"
    click.echo(line)


@path_command()
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C.")
def status(path: Path, cache: Path | None, as_json: bool, watch: bool) -> None:
    """Files and bytes per state, drain rate and ETA, errors, local tier use."""
    target = resolve([path], cache)
    if target.mountpoint is not None and target.daemon is None:
        click.echo(
            f"warning: {target.mountpoint} is mounted but its daemon does not answer (crashed?); "
            f"showing the journal; clean up with: fusermount3 -u {target.mountpoint}",
            err=True,
        )
    try:
        while True:
            doc = _status_doc(target)
            if watch and not as_json and sys.stdout.isatty():
                click.clear()
            emit_json(doc) if as_json else _print_status(doc)
            if not watch:
                return
            time.sleep(WATCH_INTERVAL_S)
            if watch and not as_json and not sys.stdout.isatty():
                click.echo("")
    except KeyboardInterrupt:
        return


def _held_line(held: dict[str, Any]) -> str:
    """One checkpoint whose marker waits, and for whom (docs/SEMANTICS.md "Many nodes")."""
    where = shown(held["dir"] or "/")
    if held["abandoned"]:
        return f"checkpoint {where} abandoned (its marker is never published)"
    others = [
        (
            f"node {w['node']} (intent {datetime.datetime.fromtimestamp(w['intent_time']):%H:%M}, no done)"
            if w["round"]
            else f"node {w['node']} (had a part where this marker was renamed from; not renamed here yet)"
        )
        + ("" if w["dir"] == held["dir"] else f" in {shown(w['dir'])}")
        for w in held["waiting"]
    ]
    if held["own_pending"]:
        others.append("this node's own files")
    unrecorded = held.get("unrecorded")  # absent from an older daemon's document
    if unrecorded:
        unrecorded_count = held.get("unrecorded_count", len(unrecorded))
        others.append(
            f"{count(unrecorded_count, 'file')} its index names, not in any node's done record yet "
            f"(first: {shown(unrecorded[0])})"
        )
    line = f"checkpoint {where} waiting for " + ", ".join(others)
    rewrites = held.get("pointer_rewrites")  # absent from an older daemon's document
    if rewrites:
        line += (
            f" (its pointer was rewritten {'once' if rewrites == 1 else f'{rewrites} times'} while it waited: "
            "each step drains slower than the next is written, so the remote pointer does not advance)"
        )
    return line


@path_command(name="ls")
def ls_command(path: Path, cache: Path | None, as_json: bool) -> None:
    """Per-file state, size, generation, digest and remote key."""
    target = resolve([path], cache)
    rel = target.rels[0]
    if target.daemon:
        doc = target.daemon.call("ls", path=rel)
    else:
        doc = journal_call(target, list_files, rel, CacheLock(target.cache_dir).owner_pid() is not None)
    if as_json:
        emit_json(doc)
        return
    rows = [
        [f["state"], fmt_bytes(f["size"]), str(f["generation"]), f["digest"] or "-", f["path"], f["remote_key"] or "-"]
        for f in doc["files"]
    ]
    click.echo(table(["STATE", "SIZE", "GEN", "DIGEST", "PATH", "REMOTE KEY"], rows, right=(1, 2)))
    for f in doc["files"]:
        if f["error"]:
            click.echo(shown(f"{f['path']}: {f['error']}"))


@path_command(many=True)
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds (exit 3).")
def wait(paths: tuple[Path, ...], cache: Path | None, as_json: bool, timeout: float | None) -> None:
    """Block until the files (or everything under the directories) are durable.

    Durable means the remote holds each file at its path (a file renamed after its
    upload waits for its object to move) and objects removed under the paths are
    deleted there.  Exit 0 when all are durable, 3 on timeout, 4 when one failed, is incomplete,
    or the drain is halted.  Polls the journal read-only.
    """
    timeout = seconds_option(timeout, "timeout")
    target = resolve(paths, cache)
    bar = None if as_json else Progress("durable")
    told: list[tuple[Any, ...] | None] = [None]  # the outage last told of

    def progress(outcome: Durability) -> None:
        if bar is None:
            return
        bar.update(
            len(outcome.done),
            len(outcome.files),
            sum(r.size for _, r in outcome.done),
            sum(r.size for _, r in outcome.files),
        )
        # Why the counts stand still, once per outage (a wait on a full remote said nothing for minutes).
        outage = outcome.outage
        what = None if outage is None else (outage.get("kind"), outage["unreachable"], outage["reason"])
        if outage is not None and what != told[0]:
            bar.note(f"burstfs-admin wait: {outage_line(outage)}")
        told[0] = what

    try:
        outcome = wait_durable(target, timeout, progress)
    finally:
        if bar is not None:
            bar.close()
    files, done, broken, halted = outcome.files, outcome.done, outcome.broken, outcome.halted
    pending = outcome.pending
    result = "timeout" if outcome.result == "waiting" else outcome.result
    if as_json:
        emit_json(
            {
                "schema": SCHEMA,
                "result": result,
                "files": len(files),
                "durable": len(done),
                "halted": halted,
                "pending": [{"path": p, "state": wait_state(p, r), "error": r.error} for p, r in pending],
                "deletes": outcome.deletes,
                "records": outcome.records,
                "outage": outcome.outage,
            }
        )
    if result == "failed":
        reasons = [f"{p}: {wait_state(p, r)}" + (f" ({r.error})" if r.error else "") for p, r in broken]
        if halted:
            reasons.append(f"the drain is halted: {halted}")
        raise AdminError("not durable: " + "; ".join(reasons), EXIT_FAILED)
    if result == "timeout":
        sample = ", ".join(f"{p} ({outcome.state_of(p, r)})" for p, r in pending[:5]) + (
            " ..." if len(pending) > 5 else ""
        )
        what = f"{len(pending)} of {len(files)} files not durable: {sample}" if pending else "files durable"
        raise AdminError(
            f"timeout after {timeout:g}s: {what}{remote_left_note(outcome)}{outage_note(outcome)}",
            EXIT_TIMEOUT,
        )


class Since(click.ParamType):
    """'10m', '2h', '90s', '1d' (that long ago) or an ISO time -> epoch seconds."""

    name = "AGE|TIME"
    _ago = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        text = str(value).strip()
        match = self._ago.match(text)
        if match:
            return time.time() - float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        try:
            return datetime.datetime.fromisoformat(text).timestamp()
        except ValueError:
            self.fail(f"{text!r}: give an age (30s, 10m, 2h, 1d) or an ISO time (2024-05-01T12:00)", param, ctx)


@path_command(name="journal")
@click.option(
    "--since", type=Since(), default=0.0, help="Only events newer than this: 10m, 2h, 1d ago, or an ISO time."
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=200, show_default=True, help="At most this many (the newest)."
)
def journal_command(path: Path, cache: Path | None, as_json: bool, since: float, limit: int) -> None:
    """Recent journal events (closes, durable, renames, failures...) of files under PATH."""
    target = resolve([path], cache)
    rel = target.rels[0]
    if target.daemon is not None:
        doc = target.daemon.call("journal", since=since, path=rel, limit=limit)
    else:
        doc = journal_call(target, journal_events, since, rel, limit)
    if as_json:
        emit_json(doc)
        return
    for event in doc["events"]:
        name = event["path"] if event["path"] is not None else f"(ino {event['ino']})" if event["ino"] else ""
        what = shown(f"{name}  {event['detail']}")
        click.echo(f"{fmt_time(event['time'])}  {event['event']:<10}  {what}".rstrip())
