#!/usr/bin/env bash
# docs/communication.md's "Across nodes" table, one sitting on the two-node harness (root):
#
#   sudo benchmarks/two_nodes_sitting.sh            # every row (about 10 minutes)
#   sudo benchmarks/two_nodes_sitting.sh wire hier  # some: wire wire_slow hier hier100 auto ring
#                                                   #   hier500 hier50 bound flat500 wire100
#                                                   #   auto_pair auto_aa wire_order (not in
#                                                   #   "every row")
#
# Every comparison is one `bench train --against` invocation, paired repeat by repeat in ABBA
# order (REPEATS, 3), each run WARMUP (2) + STEPS (6) steps; a bench line is one two_nodes.sh
# call, which makes the nodes, runs, and removes them. Groups:
#   wire  jobs/gpt_wire.toml (pp=2 x dp=2 data-inner: activations cross the link): bf16 and int8
#         on the pipeline wire against fp32, at 2gbit, 500mbit and 200mbit; fp32 at 20gbit
#         (what the activations cost at 200mbit); jobs/gpt_bench.toml the same at 500mbit;
#         wire_slow: gpt_wire at 100mbit and 50mbit (2 short repeats)
#   hier  jobs/gpt_bench.toml pp=1 x dp=4, 2 ranks a node: the two-level ring against the flat
#         one, fp32 and int8, at 500mbit and 2gbit; hier100: fp32 at 100mbit (2 short repeats);
#         hier500: the fp32 pair at 500mbit alone; hier50: fp32 at 50mbit (2 short repeats)
#   bound hier's ceiling at 500mbit: the same pair at 20gbit, where the link costs next to
#         nothing (hier at 20gbit / flat at 500mbit is the most any ring could gain there);
#         flat500: the 500mbit pair the other way round, so bench prints the flat ring's time
#         split (its exposed gradient wait w: no ring can gain more than 1 / (1 - w))
#   auto  jobs/gpt_bench.toml pp=2 x dp=2: grid.order = auto against the best hand choice, and
#         an A/A pair (data-inner against itself: the sitting's noise floor), and pipeline-inner
#         against data-inner; auto_pair and auto_aa: the first two alone (one lock hold each)
#   ring  jobs/gpt_bench.toml pp=1 x dp=2, one rank a node: int8 over 2gbit, fp32 and int8 on
#         one node (shared memory)
#   wire100 gpt_wire at 100mbit, bf16 against fp32 only, SHORT_REPEATS (2) short repeats
#   wire_order gpt_wire: int8 against bf16 on the wire, at 100mbit and 50mbit (short repeats):
#         which lossy wire ranks first where activations bind (predict's order, measured)
set -uo pipefail
cd "$(dirname "$0")/.."
NODES=benchmarks/two_nodes.sh
REPEATS=${REPEATS:-3}
STEPS=(--warmup "${WARMUP:-2}" --steps "${STEPS:-6}" --repeats "$REPEATS")
GPT=(jobs/gpt_bench.toml --set train.global_batch=16)

bench() {  # bench RATE SPEC ARGS...: one paired bench train on the harness
  local rate=$1 spec=$2
  shift 2
  echo "== RATE=$rate $spec bench train $* ${STEPS[*]}"
  RATE=$rate "$NODES" run "$spec" mpihybrid bench train "$@" "${STEPS[@]}"
}

short() {  # short RATE SPEC ARGS...: bench with fewer, shorter repeats (a slow link's steps)
  local saved=("${STEPS[@]}")
  STEPS=(--warmup 1 --steps "${SHORT_STEPS:-2}" --repeats "${SHORT_REPEATS:-2}")
  bench "$@"
  STEPS=("${saved[@]}")
}

wire() {
  local rate codec
  for rate in 2gbit 500mbit 200mbit; do
    for codec in bf16 int8; do
      bench "$rate" A:2,B:2 jobs/gpt_wire.toml --set comm.p2p_codec=$codec \
        --against comm.p2p_codec=fp32
    done
  done
  bench 20gbit A:2,B:2 jobs/gpt_wire.toml
  bench 500mbit A:2,B:2 "${GPT[@]}" --set grid.pp=2 --set grid.dp=2 --set grid.order=data-inner \
    --set comm.p2p_codec=int8 --against comm.p2p_codec=fp32
}

hier500() {
  bench 500mbit A:2,B:2 "${GPT[@]}" --set grid.pp=1 --set grid.dp=4 \
    --set comm.ring=hierarchical --against comm.ring=flat
}

hier() {
  hier500
  bench 2gbit A:2,B:2 "${GPT[@]}" --set grid.pp=1 --set grid.dp=4 \
    --set comm.ring=hierarchical --against comm.ring=flat
  bench 500mbit A:2,B:2 "${GPT[@]}" --set grid.pp=1 --set grid.dp=4 --set comm.codec=int8 \
    --set comm.ring=hierarchical --against comm.ring=flat
}

wire_slow() {  # where activations bind: 100mbit and 50mbit, shorter repeats
  local rate codec
  for rate in 100mbit 50mbit; do
    for codec in bf16 int8; do
      short "$rate" A:2,B:2 jobs/gpt_wire.toml --set comm.p2p_codec=$codec \
        --against comm.p2p_codec=fp32
    done
  done
}

hier100() {  # where the link binds: 100mbit, short repeats
  short 100mbit A:2,B:2 "${GPT[@]}" --set grid.pp=1 --set grid.dp=4 \
    --set comm.ring=hierarchical --against comm.ring=flat
}

hier50() {  # where the link binds hardest: 50mbit, short repeats (a flat step is ~20 s)
  short 50mbit A:2,B:2 "${GPT[@]}" --set grid.pp=1 --set grid.dp=4 \
    --set comm.ring=hierarchical --against comm.ring=flat
}

bound() {  # the hier pair where the link costs next to nothing: the compute's share
  bench 20gbit A:2,B:2 "${GPT[@]}" --set grid.pp=1 --set grid.dp=4 \
    --set comm.ring=hierarchical --against comm.ring=flat
}

flat500() {  # the flat ring's own time split at 500mbit
  bench 500mbit A:2,B:2 "${GPT[@]}" --set grid.pp=1 --set grid.dp=4 \
    --set comm.ring=flat --against comm.ring=hierarchical
}

wire100() {  # more pairs of bf16 against fp32 where activations bind
  short 100mbit A:2,B:2 jobs/gpt_wire.toml --set comm.p2p_codec=bf16 --against comm.p2p_codec=fp32
}

wire_order() {  # the two lossy wires against each other where activations bind
  local rate
  for rate in 100mbit 50mbit; do
    short "$rate" A:2,B:2 jobs/gpt_wire.toml --set comm.p2p_codec=int8 \
      --against comm.p2p_codec=bf16
  done
}

auto_pair() {
  bench 500mbit A:2,B:2 "${GPT[@]}" --set grid.pp=2 --set grid.dp=2 --set grid.order=auto \
    --against grid.order=data-inner
}

auto_aa() {
  bench 500mbit A:2,B:2 "${GPT[@]}" --set grid.pp=2 --set grid.dp=2 --set grid.order=data-inner \
    --against grid.order=data-inner
}

auto() {
  auto_pair
  auto_aa
  bench 500mbit A:2,B:2 "${GPT[@]}" --set grid.pp=2 --set grid.dp=2 \
    --set grid.order=pipeline-inner --against grid.order=data-inner
}

ring() {
  bench 2gbit A:1,B:1 jobs/gpt_bench.toml --set grid.pp=1 --set grid.dp=2 \
    --set comm.codec=int8 --against comm.codec=fp32
  bench 2gbit A:2 jobs/gpt_bench.toml --set grid.pp=1 --set grid.dp=2 \
    --set comm.codec=int8 --against comm.codec=fp32
}

groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(wire wire_slow hier hier100 auto ring)
for group in "${groups[@]}"; do
  case $group in
    wire | wire_slow | hier | hier500 | hier100 | hier50 | bound | flat500 | wire100 | auto | \
      auto_pair | auto_aa | wire_order | ring)
      "$group" ;;
    *) echo "usage: $0 [wire] [wire_slow] [hier] [hier500] [hier100] [hier50] [bound]" \
      "[flat500] [wire100] [wire_order] [auto] [auto_pair] [auto_aa] [ring]" >&2
      exit 2 ;;
  esac
done
