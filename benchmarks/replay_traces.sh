#!/usr/bin/env bash
# The traces docs/analysis.md measures whatif's replay on, in one sitting (a round): every
# built-in schedule at pp = 2 on the GPT benchmark job, 1F1B and GPipe on the MLP laptop job at
# dp = 1, and the runs of the changes whatif predicts (M = 8, a 1.3x slower rank 1 forward): the
# table is benchmarks/whatif_pairs.py's JOBS. Then benchmarks/whatif_pairs.py reads them. From
# the repository root:
#   flock -x /tmp/mh_heavy.lock bash benchmarks/replay_traces.sh runs/replay [STEPS]
set -euo pipefail
exec "${PYTHON:-python}" benchmarks/whatif_pairs.py --write "${1:?an output folder}" "${2:-20}"
