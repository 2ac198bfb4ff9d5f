#!/usr/bin/env bash
# The FEAST training-rule ablation (Table 2) and gamma sweep (Table 13) on top of one config.
#   tools/feast_sweeps.sh configs/quickstart.yaml [parallel jobs] [extra fit options...]
# Runs land in runs/<config name>_<rule> and runs/<config name>_gamma_<g>; then
#   python tools/feast_report.py runs/<config name>_*  prints the tables and draws the plot.
set -euo pipefail
base=${1:?usage: tools/feast_sweeps.sh CONFIG [JOBS] [fit options...]}
jobs=${2:-1}
shift $(( $# >= 2 ? 2 : 1 ))
name=$(basename "$base" .yaml)
overlays=(configs/feast/ablation/rule_*.yaml configs/feast/gamma/gamma_*.yaml)
run_one() {
  local overlay=$1; shift
  local tag; tag=$(basename "$overlay" .yaml); tag=${tag#rule_}
  python -m fl_lightning fit --config "$base" --config "$overlay" --name "${name}_${tag}" ${per_job[@]+"${per_job[@]}"} "$@" \
    > "runs/${name}_${tag}.log" 2>&1 && echo "done ${name}_${tag}" || echo "FAILED ${name}_${tag} (see runs/${name}_${tag}.log)"
}
# Parallel jobs take one rank each (the jobs share the cores); one job takes the default
# (a rank per core). Results are the same either way.
per_job=()
if [ "$jobs" -gt 1 ]; then per_job=(--fabric.devices 1); fi
mkdir -p runs
running=0
for overlay in "${overlays[@]}"; do
  run_one "$overlay" "$@" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
done
wait
