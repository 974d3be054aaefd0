#!/usr/bin/env bash
# The gradient ring across a slow link, on one machine: a network namespace whose loopback is
# shaped by tc tbf (RATE, default 2gbit), with MPICH told to use its TCP netmod between local
# ranks (without those variables MPICH uses shared memory and the shaping is bypassed).
#
#   sudo benchmarks/shaped_link.sh allreduce [bench allreduce options]   # ring vs MPI_Allreduce
#   sudo benchmarks/shaped_link.sh train [bench train options]           # the dp=2 GPT job
#   sudo benchmarks/shaped_link.sh run CMD...                            # any command, shaped
#   benchmarks/shaped_link.sh table                                      # README's table (both)
#
# Needs root, ip (iproute2) and tc; netem is not used. Every traffic of the namespace goes through
# its loopback, both directions of a link share RATE. NP (2) ranks; the namespace (NS, default
# mhlink) is made and removed by each call. Run it from the project's root with the venv active.
set -euo pipefail

RATE=${RATE:-2gbit}
NS=${NS:-mhlink}
NP=${NP:-2}
REPEATS=${REPEATS:-5}
JOB=${JOB:-jobs/gpt_bench.toml}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

down() { ip netns del "$NS" 2>/dev/null || true; }

up() {
  down
  ip netns add "$NS"
  ip -n "$NS" link set lo up
  tc -n "$NS" qdisc add dev lo root tbf rate "$RATE" burst 256kb latency 50ms
}

# shaped CMD...: CMD inside the namespace, MPICH over TCP between local ranks
shaped() {
  ip netns exec "$NS" env MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp \
    PATH="$PATH" "$@"
}

mpi() { mpiexec -n "$NP" "$@"; }

allreduce() { shaped mpiexec -n "$NP" mpihybrid bench allreduce "$@"; }

train() {
  shaped mpiexec -n "$NP" mpihybrid bench train "$JOB" --set grid.pp=1 --set grid.dp="$NP" "$@"
}

# table: the README's figures, one sitting: shared memory first, then the shaped link
table() {
  echo "== shared memory: ring / MPI_Allreduce, 16 MiB, median of $REPEATS"
  mpi mpihybrid bench allreduce --sizes 16M --repeats "$REPEATS" --codecs fp32,bf16,int8
  echo "== $RATE link: ring / MPI_Allreduce, 16 MiB, median of $REPEATS"
  allreduce --sizes 16M --repeats "$REPEATS" --codecs fp32,bf16,int8
  for codec in fp32 int8; do
    echo "== shared memory: $JOB dp=$NP comm.codec=$codec"
    mpi mpihybrid bench train "$JOB" --set grid.pp=1 --set grid.dp="$NP" \
      --set comm.codec="$codec" --repeats "$REPEATS"
  done
  for codec in fp32 bf16 int8; do
    echo "== $RATE link: $JOB dp=$NP comm.codec=$codec"
    train --set comm.codec="$codec" --repeats "$REPEATS"
  done
}

command -v tc >/dev/null && command -v ip >/dev/null || {
  echo "shaped_link: needs ip and tc (apt-get install iproute2)" >&2
  exit 2
}
[ "$(id -u)" = 0 ] || { echo "shaped_link: needs root (network namespaces, tc)" >&2; exit 2; }
what=${1:-table}
shift || true
case $what in
  allreduce | train | table) up; trap down EXIT; "$what" "$@" ;;
  run) up; trap down EXIT; shaped "$@" ;;
  *) echo "usage: $0 allreduce|train|run|table [args]" >&2; exit 2 ;;
esac
