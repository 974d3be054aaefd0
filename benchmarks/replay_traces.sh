#!/usr/bin/env bash
# The traces docs/analysis.md measures whatif's replay on: every built-in schedule at pp = 2 on
# the GPT benchmark job, and 1F1B on the MLP laptop job at dp = 1. Run from the repository root:
#   flock -x /tmp/mh_heavy.lock bash benchmarks/replay_traces.sh runs/replay [STEPS]
set -euo pipefail
out=${1:?an output folder}
steps=${2:-20}
mkdir -p "$out"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
py=${PYTHON:-python}
mpiexec=${MPIEXEC:-mpiexec}
train() {  # name, job, settings...
    local name=$1 job=$2
    shift 2
    "$mpiexec" -n 2 "$py" -m mpihybrid train "$job" --quiet --set train.steps="$steps" \
        --trace "$out/$name.h5" --set trace.overwrite=true "$@" >/dev/null
    echo "$out/$name.h5"
}
for s in naive gpipe 1f1b zb-h1 zb-h2 zb-v dualpipev v-half; do
    train "gpt_$s" mpihybrid/jobs/gpt_bench.toml --set train.schedule=$s
done
train gpt_interleaved-1f1b mpihybrid/jobs/gpt_bench.toml --set train.schedule=interleaved-1f1b \
    --set train.virtual_stages=2 --set model.depth=4
train mlp_1f1b mpihybrid/jobs/laptop.toml --set grid.dp=1
train mlp_gpipe mpihybrid/jobs/laptop.toml --set grid.dp=1 --set train.schedule=gpipe
