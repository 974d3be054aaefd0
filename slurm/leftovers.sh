#!/usr/bin/env bash
# Remove what this job's killed ranks left outside TMPDIR on this node: MPICH's shared-memory
# segments (/dev/shm/mpich_shm_*) and its launcher's topology files (TMPDIR/hydra_hwloc_xmlfile_*),
# those of this user changed since SINCE (seconds since the epoch: when the job's step started),
# so that an earlier job's (or another user's) are never touched. slurm/train.sbatch runs it on
# every node of the job before a requeue.
#
#   slurm/leftovers.sh SINCE             # SHM_DIR=/dev/shm and TMPDIR=/tmp by default
set -euo pipefail
since=${1:?usage: leftovers.sh SINCE-EPOCH-SECONDS}
[[ $since =~ ^[0-9]+$ ]] || { echo "leftovers.sh: SINCE=$since: seconds since the epoch" >&2; exit 2; }
shm=${SHM_DIR:-/dev/shm}
tmp=${TMPDIR:-/tmp}
for spec in "$shm:mpich_shm_*" "$tmp:hydra_hwloc_xmlfile_*"; do
    dir=${spec%%:*}
    [[ -d $dir ]] || continue
    find "$dir" -maxdepth 1 -user "$(id -u)" -name "${spec#*:}" -newermt "@$since" \
        -print -exec rm -rf -- {} + 2>/dev/null || true
done
