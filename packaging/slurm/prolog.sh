#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/burstfs/slurm/prolog.sh, PrologFlags=Alloc):
# mount burstfs for this job on this node at $BURSTFS_MOUNT_ROOT/$SLURM_JOB_ID,
# owned by the job's user.  Runs as root before the job starts.  A failure
# (e.g. the remote is unreachable) exits non-zero: Slurm drains the node and
# requeues the job (docs/OPERATIONS.md, "Slurm").
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
. "${BURSTFS_SLURM_CONF:-/etc/burstfs/slurm.env}"

job=${SLURM_JOB_ID:?not run by Slurm}
user=${SLURM_JOB_USER:?}
mnt=$BURSTFS_MOUNT_ROOT/$job
cache=$BURSTFS_CACHE_ROOT/job-$job
remote=${BURSTFS_REMOTE//\{user\}/$user}
remote=${remote//\{job\}/$job}

log() { echo "$(date -Is) burstfs-prolog job=$job $*" >> "$BURSTFS_CACHE_ROOT/slurm.log"; }

fail() {
    log "event=mount_failed mountpoint=$mnt error=\"$1\""
    rmdir "$mnt" 2>/dev/null || true
    exit 1
}

# A requeued job on this node: its epilog may still drain the same cache in the
# background (the remote was down then).  This job's mount drains the rest.
stop_background_drain() {
    local pid
    pid=$(tr -dc 0-9 < "$cache/lock" 2>/dev/null) || return 0
    [[ -n $pid && -r /proc/$pid/cmdline ]] || return 0
    if tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF " drain --cache $cache "; then
        log "event=background_drain_stopped pid=$pid cache=$cache (this job's mount drains the rest)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 300); do
            [[ -d /proc/$pid ]] || break
            sleep 0.1
        done
    fi
}

mkdir -p "$BURSTFS_CACHE_ROOT" "$mnt"
chmod 755 "$BURSTFS_MOUNT_ROOT"
if [[ $remote == file://* ]]; then
    # Only the per-user/per-job part is made here: the directory above it must exist, so
    # that a parallel file system not mounted on this node fails the job instead of
    # taking its checkpoints onto the node's own disk under the empty mount point.
    template=${BURSTFS_REMOTE#file://}
    base=${template%%\{*}
    base=${base%/*}
    [[ -d ${base:-/} ]] || fail "remote directory ${base} does not exist (is its file system mounted on this node?)"
    mkdir -p "${remote#file://}"
fi
stop_background_drain
options=(--cache "$cache" --remote "$remote" --allow-other)
if [[ -n ${BURSTFS_CONFIG:-} ]]; then
    options+=(--config "$BURSTFS_CONFIG")
fi
for attempt in 1 2 3; do  # the background drain removing a drained cache holds its lock briefly
    out=$("$BURSTFS" mount "$mnt" "${options[@]}" 2>&1) && break
    [[ $attempt -lt 3 && $out == *"is in use by another burstfs process"* ]] || fail "$out"
    sleep 2
done
# The job's user owns the mount, and the entries the remote's listing brought in at
# mount time (they took the owner of their directory, root, then): a later job can
# write into an earlier run's directories.  Entries listed later take the owner of
# their directory, now the job's user.
chown "$SLURM_JOB_UID:$SLURM_JOB_GID" "$mnt"
find "$mnt" -mindepth 1 -maxdepth 1 -exec chown -h "$SLURM_JOB_UID:$SLURM_JOB_GID" {} +
log "event=mounted mountpoint=$mnt cache=$cache remote=$remote"
