#!/usr/bin/env bash
# The traces docs/analysis.md measures whatif's replay on, in one sitting: every built-in
# schedule at pp = 2 on the GPT benchmark job, 1F1B and GPipe on the MLP laptop job at dp = 1,
# and the runs of the changes whatif predicts (M = 8, a 1.3x slower rank 1 forward). Then
# benchmarks/whatif_pairs.py reads them. From the repository root:
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
train gpt_1f1b_m8 mpihybrid/jobs/gpt_bench.toml --set train.microbatches=8
train gpt_gpipe_m8 mpihybrid/jobs/gpt_bench.toml --set train.schedule=gpipe --set train.microbatches=8
train mlp_1f1b_m8 mpihybrid/jobs/laptop.toml --set grid.dp=1 --set train.microbatches=8
train gpt_1f1b_slow mpihybrid/jobs/gpt_bench.toml --set train.slowdown=1:F:1.3
