#!/usr/bin/env bash
# The schedule search measured (docs/schedules.md, "Searched schedules"), one part per lock:
#   flock -x /tmp/mh_heavy.lock benchmarks/search_sitting.sh solver
#   flock -x /tmp/mh_heavy.lock benchmarks/search_sitting.sh pp2|pp4|head
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
solver)  # the exact search's times with unit costs, pp <= 4, M <= 8, both placements
    for pp in 2 3 4; do for m in 4 8; do
        echo "== pp=$pp M=$m"
        mpihybrid schedule search --pp "$pp" -m "$m" --no-grid --time-limit 60 | grep -E "^found|^solver"
    done; done
    echo "== gpt_bench_pp4's timed blocks, pp=4 M=8"
    mpihybrid schedule search --job jobs/gpt_bench_pp4.toml --no-grid --time-limit 60 ;;
pp2)
    mpihybrid schedule search --job jobs/gpt_bench.toml --no-grid
    mpiexec -n 2 mpihybrid bench train jobs/gpt_bench.toml --set train.schedule=auto \
        --against train.schedule=dualpipev --repeats 3 ;;
pp4)  # 4 ranks on 2 cores: oversubscribed
    mpihybrid schedule search --job jobs/gpt_bench_pp4.toml --no-grid
    mpiexec -n 4 mpihybrid bench train jobs/gpt_bench_pp4.toml --set train.schedule=auto \
        --against train.schedule=dualpipev --repeats 3 --steps 6 --warmup 2 ;;
head)
    mpihybrid schedule search --job jobs/gpt_bench_head.toml --no-grid
    mpiexec -n 2 mpihybrid bench train jobs/gpt_bench_head.toml --set train.schedule=auto \
        --against train.schedule=zb-h1 --against model.partition=timed --repeats 3 ;;
*) echo "usage: $0 solver|pp2|pp4|head" >&2; exit 2 ;;
esac
