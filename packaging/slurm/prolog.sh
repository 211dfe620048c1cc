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

mkdir -p "$BURSTFS_CACHE_ROOT" "$mnt"
chmod 755 "$BURSTFS_MOUNT_ROOT"
if [[ $remote == file://* ]]; then
    mkdir -p "${remote#file://}"
fi
options=(--cache "$cache" --remote "$remote" --allow-other)
if [[ -n ${BURSTFS_CONFIG:-} ]]; then
    options+=(--config "$BURSTFS_CONFIG")
fi
if ! out=$("$BURSTFS" mount "$mnt" "${options[@]}" 2>&1); then
    log "event=mount_failed mountpoint=$mnt error=\"$out\""
    rmdir "$mnt" 2>/dev/null || true
    exit 1
fi
chown "$SLURM_JOB_UID:$SLURM_JOB_GID" "$mnt"
log "event=mounted mountpoint=$mnt cache=$cache remote=$remote"
