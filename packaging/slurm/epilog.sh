#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/burstfs/slurm/epilog.sh): the clean end of a
# job's burstfs mount on this node.  Runs as root after the job's processes are gone.
#
# Waits up to BURSTFS_EPILOG_DRAIN_TIMEOUT seconds for everything the job closed
# to be durable, then unmounts and removes the job's cache dir.  If the wait runs
# out (a slow or failing remote), it reports what is still staged, unmounts (the
# data stays staged and journaled in the cache dir) and keeps draining it in the
# background with `burstfs drain`, which removes the cache once it is durable.
# Reports go to $BURSTFS_CACHE_ROOT/slurm.log.  Exit 1 (Slurm drains the node)
# only if the mount cannot be removed.
set -uo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
. "${BURSTFS_SLURM_CONF:-/etc/burstfs/slurm.env}"

job=${SLURM_JOB_ID:?not run by Slurm}
mnt=$BURSTFS_MOUNT_ROOT/$job
cache=$BURSTFS_CACHE_ROOT/job-$job
timeout=${BURSTFS_EPILOG_DRAIN_TIMEOUT:-600}

log() { echo "$(date -Is) burstfs-epilog job=$job $*" >> "$BURSTFS_CACHE_ROOT/slurm.log"; }
indent() { sed 's/^/    /' >> "$BURSTFS_CACHE_ROOT/slurm.log"; }

if ! mountpoint -q "$mnt"; then
    rmdir "$mnt" 2>/dev/null || true
    exit 0
fi
started=$SECONDS
if out=$("$BURSTFS" unmount --wait --wait-timeout "$timeout" "$mnt" 2>&1); then
    log "event=durable mountpoint=$mnt"
    echo "$out" | indent
    rm -rf "$cache"
    rmdir "$mnt"
    exit 0
fi
log "event=not_durable mountpoint=$mnt waited_s=$((SECONDS - started)) reason=\"$out\""
"$BURSTFS_ADMIN" status "$mnt" 2>&1 | indent
if ! "$BURSTFS" unmount "$mnt" 2>&1 | indent; then
    fusermount3 -u -z "$mnt" 2>&1 | indent
fi
if mountpoint -q "$mnt"; then
    log "event=unmount_failed mountpoint=$mnt"
    exit 1
fi
rmdir "$mnt" 2>/dev/null || true
log "event=draining_in_background cache=$cache (burstfs-admin status $cache)"
# Removed under its lock, renamed aside first: a requeued job's prolog that took the
# cache meanwhile keeps it, and never finds it half removed.
setsid bash -c '"$1" drain --cache "$2" --now >> "$3" 2>&1 \
    && flock -n "$2/lock" mv "$2" "$2.removed.$$" && rm -rf "$2.removed.$$"' drain "$BURSTFS" "$cache" \
    "$BURSTFS_CACHE_ROOT/slurm.log" < /dev/null > /dev/null 2>&1 &
drainer=$!
# slurmd kills the epilog's process group as soon as the epilog exits: leave only
# once the drain is in a session of its own.
for _ in $(seq 100); do
    [[ $(ps -o sid= -p "$drainer" | tr -d ' ') == "$drainer" ]] && break
    sleep 0.05
done
exit 0
