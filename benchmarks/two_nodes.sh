#!/usr/bin/env bash
# Two nodes on one machine: network namespaces A and B, each with one link (a veth) to a bridge
# in the root namespace (the hub, where mpiexec runs), each link's node end shaped by tc tbf to
# RATE (every direction between the nodes carries RATE, like a full-duplex NIC), MPICH between
# the nodes over its OFI netmod with the tcp provider, shared memory inside a node.
#
#   sudo benchmarks/two_nodes.sh run A:2,B:2 CMD...      # up, mpiexec CMD over the nodes, down
#   sudo RATE=500mbit benchmarks/two_nodes.sh run A:2,B:2 mpihybrid bench train jobs/gpt_bench.toml
#   sudo benchmarks/two_nodes.sh up | down | status | tx  # by hand; mpiexec SPEC CMD... between
#   sudo benchmarks/two_nodes.sh run A:2,B:2 python benchmarks/two_nodes_probe.py   # check it
#
# SPEC places ranks in order: A:2,B:2 is ranks 0-1 on node A and 2-3 on node B (A:1,B:2 three
# ranks); the world size is the sum. How the launch works: mpiexec (MPICH's Hydra, from PATH) runs
# on the hub and starts one proxy per node through this script as its "ssh" (-launcher-exec),
# which runs the proxy's command in that node's namespace under a hostname of its own (a UTS
# namespace). Hydra tells MPICH which ranks share a proxy, so those use shared memory; the others
# reach each other by TCP over the shaped veth (FI_TCP_IFACE). MPI_Comm_split_type(SHARED) then
# reports the two nodes. `tx` prints the bytes each node's link end has sent: the difference over
# a run is what crossed between the nodes (Hydra's own control messages are a few KiB).
#
# Environment: RATE (2gbit), BURST (256kb), LIMIT (tbf's queue bound, 50ms), MTU (9000),
# TWO_NODES (name prefix, mh2n: namespaces mh2nA and mh2nB), SUBNET (10.77.0: A is .1, B is .2,
# the hub .254).
# Needs root, ip and tc (iproute2) and unshare (util-linux); netem is not used. Run it from the
# project's root with the venv active (PATH gives its mpiexec and mpihybrid to every node).
set -uo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
PREFIX=${TWO_NODES:-mh2n}
SUBNET=${SUBNET:-10.77.0}
LINK=${PREFIX}link  # each node's end of its link (the other end is on the hub, a bridge)
HUB=${PREFIX}hub

ns_of() { echo "$PREFIX$1"; }
addr_of() {
  case $1 in
    A | "$SUBNET.1") echo "$SUBNET.1" ;;
    B | "$SUBNET.2") echo "$SUBNET.2" ;;
    *) return 1 ;;
  esac
}
node_of() {
  case $1 in
    A | "$SUBNET.1" | "${PREFIX}A") echo A ;;
    B | "$SUBNET.2" | "${PREFIX}B") echo B ;;
    *) return 1 ;;
  esac
}
has_ns() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }

# down: each step alone undoes one thing and none needs the one before, so a kill between two
# leaves what the next `down` (every `up` runs one first) removes
down() {
  local node ns pids
  for node in A B; do
    ns=$(ns_of $node)
    if has_ns "$ns"; then
      # a rank a failed run left behind keeps the namespace's link alive: end it
      pids=$(ip netns pids "$ns" 2>/dev/null)
      [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
      ip netns del "$ns" 2>/dev/null
    fi
    ip link del "$PREFIX$node" 2>/dev/null  # the root end (normally gone with the namespace)
    rm -rf "/etc/netns/$ns"
  done
  ip link del "$HUB" 2>/dev/null
  rmdir /etc/netns 2>/dev/null
  return 0
}

up() {
  local rate=${RATE:-2gbit} burst=${BURST:-256kb} limit=${LIMIT:-50ms} mtu=${MTU:-9000} node ns
  down
  { ip link add "$HUB" mtu "$mtu" type bridge && ip addr add "$SUBNET.254/24" dev "$HUB" &&
      ip link set "$HUB" up; } || { echo "two_nodes: cannot make bridge $HUB" >&2; down; return 1; }
  for node in A B; do
    ns=$(ns_of $node)
    { ip netns add "$ns" &&
        ip link add "$PREFIX$node" mtu "$mtu" type veth peer name "$LINK" mtu "$mtu" netns "$ns" &&
        ip link set "$PREFIX$node" master "$HUB" && ip link set "$PREFIX$node" up &&
        ip -n "$ns" link set lo up &&
        ip -n "$ns" addr add "$(addr_of $node)/24" dev "$LINK" &&
        ip -n "$ns" link set "$LINK" up &&
        tc -n "$ns" qdisc add dev "$LINK" root tbf rate "$rate" burst "$burst" latency "$limit" &&
        mkdir -p "/etc/netns/$ns" &&
        printf '127.0.0.1 localhost\n%s %sA\n%s %sB\n%s %shub\n' "$SUBNET.1" "$PREFIX" \
          "$SUBNET.2" "$PREFIX" "$SUBNET.254" "$PREFIX" >"/etc/netns/$ns/hosts"; } ||
      { echo "two_nodes: cannot set up node $node" >&2; down; return 1; }
  done
  # each node reaches the other and the hub (where mpiexec listens): a connect to a closed
  # port is refused at once when the address is reachable
  local from to answer
  for from in A B; do
    for to in "$SUBNET.254" "$SUBNET.1" "$SUBNET.2"; do
      answer=$(ip netns exec "$(ns_of $from)" timeout 3 bash -c "exec 3<>/dev/tcp/$to/9" 2>&1)
      case $answer in
        *refused*) ;;
        *) echo "two_nodes: node $from does not reach $to ($answer)" >&2; down; return 1 ;;
      esac
    done
  done
}

status() {
  local node
  for node in A B; do
    echo "node $node: namespace $(ns_of $node), $(addr_of $node)"
    ip netns exec "$(ns_of $node)" tc -s qdisc show dev "$LINK" 2>&1 | sed 's/^/  /'
  done
}

tx() {
  local node out=()
  for node in A B; do
    out+=("$(ip netns exec "$(ns_of $node)" cat "/sys/class/net/$LINK/statistics/tx_bytes" \
      2>/dev/null || echo -1)")
  done
  echo "${out[@]}"
}

# launch SPEC CMD...: mpiexec on the hub, one proxy per node through this script
launch() {
  local spec=$1 hosts="" np=0 item node count
  shift
  local IFS=,
  for item in $spec; do
    node=${item%%:*} count=${item#*:}
    [ "$count" = "$item" ] && count=1
    addr_of "$node" >/dev/null && [[ $count =~ ^[1-9][0-9]*$ ]] ||
      { echo "two_nodes: '$item' is not NODE:RANKS (A or B)" >&2; return 2; }
    hosts="${hosts:+$hosts,}$(addr_of "$node"):$count"
    np=$((np + count))
  done
  unset IFS
  has_ns "$(ns_of A)" || { echo "two_nodes: the nodes are not up ($0 up)" >&2; return 2; }
  env -u MPIR_CVAR_NOLOCAL HYDRA_LAUNCHER_AUTOFORK=0 \
    MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE="$LINK" TWO_NODES="$PREFIX" \
    SUBNET="$SUBNET" \
    mpiexec -launcher ssh -launcher-exec "$SELF" -localhost "$SUBNET.254" -hosts "$hosts" \
    -n "$np" "$@"
}

# as Hydra's ssh: [options] HOST WORDS...; the words are one shell command, run on HOST
as_ssh() {
  while [ $# -gt 0 ]; do
    case $1 in
      -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
      -*) shift ;;
      *) break ;;
    esac
  done
  local node
  node=$(node_of "${1#*@}") || { echo "two_nodes: no node named '$1'" >&2; exit 255; }
  shift
  exec ip netns exec "$(ns_of "$node")" unshare --uts \
    sh -c 'hostname "$1" && exec sh -c "$2"' sh "$PREFIX$node" "$*"
}

need() {
  [ "$(id -u)" = 0 ] || { echo "two_nodes: needs root (network namespaces, tc)" >&2; exit 2; }
  command -v ip >/dev/null && command -v tc >/dev/null && command -v unshare >/dev/null || {
    echo "two_nodes: needs ip, tc (iproute2) and unshare (util-linux)" >&2
    exit 2
  }
}

case ${1:-} in
  up) need; up ;;
  down) need; down ;;
  status) need; status ;;
  tx) need; tx ;;
  mpiexec) need; shift; launch "$@" ;;
  run)
    need
    shift
    [ $# -ge 2 ] || { echo "usage: $0 run SPEC CMD..." >&2; exit 2; }
    # the traps first: a signal while the nodes come up takes them down too
    trap down EXIT
    trap 'exit 143' TERM INT HUP
    up || exit 1
    # mpiexec in the background: bash runs a trap only once its foreground command ends, and a
    # SIGKILL a short grace after the SIGTERM (timeout -k 5) would cut that wait, the nodes up
    launch "$@" &
    child=$!
    trap 'kill -TERM "$child" 2>/dev/null; exit 143' TERM INT HUP
    wait "$child"
    exit $?
    ;;
  -* | "$SUBNET".* | A | B | "$PREFIX"A | "$PREFIX"B) as_ssh "$@" ;;  # called by Hydra
  *) sed -n '2,25p' "$0" >&2; exit 2 ;;
esac
