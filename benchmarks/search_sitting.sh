#!/usr/bin/env bash
# The schedule search measured (docs/schedules.md, "Searched schedules"), one part per lock:
#   flock -x /tmp/mh_heavy.lock benchmarks/search_sitting.sh solver
#   flock -x /tmp/mh_heavy.lock benchmarks/search_sitting.sh pp2|pp4|head2|head4 [BUILTIN]
#   flock -x /tmp/mh_heavy.lock benchmarks/search_sitting.sh bubble pp2|head2 [RUNS]
# A job part prints the search on the job's blocks timed here (the built-ins simulated on the same
# costs beside it), then pairs train.schedule=auto against BUILTIN (default: the built-in the
# search's table ranks fastest), both with model.partition=timed, in ABBA order (bench train
# --against). The load average is printed before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_ARGS overrides the bench's repeats and steps (a loaded machine: fewer, to keep a part short)
NP=2; JOB=jobs/gpt_bench.toml; SET=(); BENCH=(--repeats 3)
case "${1:-}" in
solver)  # the exact search's times with unit costs, pp <= 4, M <= 8, both placements
    for pp in 2 3 4; do for m in 4 8; do
        echo "== pp=$pp M=$m"
        mpihybrid schedule search --pp "$pp" -m "$m" --no-grid --time-limit 60 | grep -E "^found|^solver"
    done; done
    exit 0 ;;
bubble)  # the search's predicted bubble against the run's: RUNS (3) runs of 12 steps, each
    # searching again, then analyze's measured and predicted lines
    [ "${2:-pp2}" = head2 ] && JOB=jobs/gpt_bench_head.toml
    out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
    echo "load $(cut -d' ' -f1-3 /proc/loadavg) at $(date -u +%H:%M:%S)"
    for i in $(seq "${3:-3}"); do
        mpiexec -n 2 mpihybrid train "$JOB" --set model.partition=timed --set train.schedule=auto \
            --set train.steps=12 --trace "$out/run.h5" --overwrite --quiet > /dev/null
        mpihybrid analyze "$out/run.h5" | grep -E "^bubble|^searched"
    done
    echo "load $(cut -d' ' -f1-3 /proc/loadavg) at $(date -u +%H:%M:%S)"
    exit 0 ;;
pp2) ;;
pp4) NP=4; JOB=jobs/gpt_bench_pp4.toml; BENCH=(--repeats 2 --steps 6 --warmup 2) ;;  # 4 ranks, 2 cores
head2) JOB=jobs/gpt_bench_head.toml ;;
head4) NP=4; JOB=jobs/gpt_bench_head.toml
    SET=(--set grid.pp=4 --set train.microbatches=8 --set train.global_batch=16)
    BENCH=(--repeats 2 --steps 6 --warmup 2) ;;
*) echo "usage: $0 solver|pp2|pp4|head2|head4 [BUILTIN] | bubble pp2|head2 [RUNS]" >&2; exit 2 ;;
esac
echo "load $(cut -d' ' -f1-3 /proc/loadavg) at $(date -u +%H:%M:%S)"
[ -n "${BENCH_ARGS:-}" ] && read -r -a BENCH <<< "$BENCH_ARGS"
table=$(mpihybrid schedule search --job "$JOB" "${SET[@]}" --no-grid --time-limit 10)
echo "$table"
best=${2:-$(echo "$table" | awk '/^schedule +v +step/{t=1; next} t && $3 ~ /^[0-9.]+$/ && (b == "" || $3 < s) {s = $3; b = $1} END {print b}')}
echo "== auto against $best (model.partition=timed for both)"
other=(--against "train.schedule=$best")
[ "$best" = interleaved-1f1b ] && other+=(--against train.virtual_stages=2)  # the table's v
mpiexec -n "$NP" mpihybrid bench train "$JOB" "${SET[@]}" --set model.partition=timed \
    --set train.schedule=auto "${other[@]}" "${BENCH[@]}"
echo "load $(cut -d' ' -f1-3 /proc/loadavg) at $(date -u +%H:%M:%S)"
