#!/usr/bin/env bash
# The gradient ring across a slow link, on one machine: a network namespace whose loopback is
# shaped by tc tbf (RATE, default 2gbit), with the MPI told to use TCP between local ranks
# (without that, MPICH and Open MPI use shared memory and the shaping is bypassed).
#
#   sudo benchmarks/shaped_link.sh allreduce [bench allreduce options]   # ring vs MPI_Allreduce
#   sudo benchmarks/shaped_link.sh train [bench train options]           # the dp=2 GPT job
#   sudo benchmarks/shaped_link.sh run CMD...                            # any command, shaped
#   benchmarks/shaped_link.sh table                                      # README's table (both)
#
# Needs root, ip (iproute2) and tc; netem is not used. Every traffic of the namespace goes through
# its loopback, both directions of a link share RATE. NP (2) ranks; the namespace (NS, default
# mhlink) is made and removed by each call; BURST (256kb, at least the loopback's 64 KiB MTU, or a
# full packet never passes) and LIMIT (50ms) are tbf's bucket and
# queue bound. Run it from the project's root with the venv active.
set -euo pipefail

RATE=${RATE:-2gbit}
BURST=${BURST:-256kb}
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
  tc -n "$NS" qdisc add dev lo root tbf rate "$RATE" burst "$BURST" latency "${LIMIT:-50ms}"
}

# What this MPI needs (mpihybrid/launch.py does the same for the tests): Open MPI starts more
# ranks than cores with --oversubscribe and runs as root (this script is) with
# --allow-run-as-root; it is told to use TCP between local ranks by leaving out its
# shared-memory transport. Open MPI has no MPICH NOLOCAL: its ranks still see one node, so the
# ring's own shared-memory wire (lossy codecs) would bypass the link; `allreduce` asks for
# --transport mpi, `train` says so.
if mpiexec --version 2>&1 | grep -q "Open MPI\|OpenRTE"; then
  OPEN_MPI=1
  LAUNCH=(--oversubscribe --allow-run-as-root)
  TCP=(OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,self OMPI_MCA_btl_tcp_if_include=lo)
else
  OPEN_MPI=0
  LAUNCH=()
  TCP=(MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp)
fi

# shaped CMD...: CMD inside the namespace, the MPI over TCP between local ranks
shaped() {
  ip netns exec "$NS" env "${TCP[@]}" PATH="$PATH" "$@"
}

mpi() { mpiexec -n "$NP" "${LAUNCH[@]}" "$@"; }

allreduce() {
  local transport=()
  if ((OPEN_MPI)); then transport=(--transport mpi); fi
  shaped mpiexec -n "$NP" "${LAUNCH[@]}" mpihybrid bench allreduce "${transport[@]}" "$@"
}

train() {
  if ((OPEN_MPI)); then
    echo "shaped_link: Open MPI: a lossy codec's ring reads its neighbour's shared memory," \
      "only fp32 crosses the shaped link (MPICH's MPIR_CVAR_NOLOCAL has no Open MPI twin)" >&2
  fi
  shaped mpiexec -n "$NP" "${LAUNCH[@]}" mpihybrid bench train "$JOB" --set grid.pp=1 \
    --set grid.dp="$NP" "$@"
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
