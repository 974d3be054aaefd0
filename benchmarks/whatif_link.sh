#!/usr/bin/env bash
# whatif's "a slower link" against real runs over one: gpt_bench at pp = 2 with its two stages on
# two nodes (benchmarks/two_nodes.sh: a veth a node, each direction shaped to RATE, like a
# full-duplex NIC), traced at each rate; then each slower rate predicted from each faster run by
# `whatif --scale hop=F` (F: the ratio of the rates), also with `--set link=duplex` (a message
# holds its link and the next one waits), and set against its measured step.
#
#   sudo bash benchmarks/whatif_link.sh runs/link [RATES (Mbit/s, fastest first)] [STEPS]
#   sudo bash benchmarks/whatif_link.sh runs/link "40 20 10" 10
#
# BURST is 32kb and tbf's queue bound 2 s, so that a message (123 KB of activations) is shaped
# rather than dropped. Needs what two_nodes.sh needs (root, iproute2, util-linux, MPICH).
set -euo pipefail
out=${1:?an output folder}
rates=(${2:-40 20 10})
steps=${3:-10}
py=${PYTHON:-python}
mkdir -p "$out"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for r in "${rates[@]}"; do
    RATE=${r}mbit BURST=32kb LIMIT=2s bash "$(dirname "$0")/two_nodes.sh" run A:1,B:1 \
        "$py" -m mpihybrid train mpihybrid/jobs/gpt_bench.toml --quiet \
        --set train.steps="$steps" --set trace.overwrite=true --trace "$out/link_$r.h5" >/dev/null
done
"$py" - "$out" "${rates[@]}" <<'PY'
import sys
from mpihybrid.analysis.replay import Change, Measured, mean_of, measured_figures, replay
from mpihybrid.trace.read import load

out, rates = sys.argv[1], [int(r) for r in sys.argv[2:]]
LINK = "duplex"  # two_nodes.sh's links: each direction its own RATE
runs = {r: Measured.of(load(f"{out}/link_{r}.h5")) for r in rates}
print("rate       measured step   hop")
for r, m in runs.items():
    print(f"{r:4d} Mbit/s  {1e3 * measured_figures(m)['step']:8.1f} ms  {1e3 * mean_of(m).send:6.2f} ms")
errs = []
for i, fast in enumerate(rates):
    for slow in rates[i + 1:]:
        factor = fast / slow
        want = measured_figures(runs[slow])["step"]
        said = []
        for link in (None, LINK):
            got = replay(runs[fast], Change(scales={"hop": factor}, link=link))["step"]
            said.append(f"{1e3 * got:.1f} ms ({got / want - 1:+.1%})")
        errs.append(abs(got / want - 1))
        print(f"{fast} -> {slow} Mbit/s (hop x{factor:g}): measured {1e3 * want:.1f} ms, "
              f"predicted {said[0]}, with link={LINK} {said[1]}")
print(f"worst {max(errs):.1%} over {len(errs)} pairs (with link={LINK})")
PY
