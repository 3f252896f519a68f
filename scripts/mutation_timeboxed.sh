#!/usr/bin/env bash
# The Python mutation run of `make mutation` inside a time box, on as many cores as there are:
# first the deterministic sample of data/mutation.json (scripts/mutation_sample.py), then every
# other mutant of the same patterns until the deadline. mutmut records each verdict as it comes,
# so what ran before the deadline is kept; `mutmut results` and scripts/mutation_report.py read it.
#
#   scripts/mutation_timeboxed.sh SECONDS [CHILDREN]
set -uo pipefail
deadline=$(( $(date +%s) + ${1:?usage: scripts/mutation_timeboxed.sh SECONDS [CHILDREN]} ))
children=${2:-$(nproc)}
export GRAPHBORROW_SIM_PURE=1 OMP_NUM_THREADS=1
mutmut=${MUTMUT:-mutmut}
patterns=('graphborrow.core.arena.*' 'graphborrow.core.runs.*' 'graphborrow.core.snapshot.*' 'graphborrow.core.borrow.*'
  'graphborrow.allocator.stats.*' 'graphborrow.allocator.restore.x_take_over_stats*')
sample=('graphborrow.core.runs.*=2' 'graphborrow.core.borrow.*=2' 'graphborrow.allocator.stats.xǁStat*=2'
  'graphborrow.allocator.stats.x_update_stat_array*=2' 'graphborrow.allocator.stats.xǁDeviceStatsǁ*=2'
  'graphborrow.allocator.restore.x_take_over_stats*=2' 'graphborrow.core.arena.*=6' 'graphborrow.core.snapshot.*=6')

left() { echo $(( deadline - $(date +%s) )); }
step() {  # label, mutmut arguments...
  local label=$1; shift
  local t; t=$(left)
  if [ "$t" -le 5 ]; then echo "== $label: no time left"; return; fi
  echo "== $label ($t s left)"
  timeout --signal=INT --kill-after=20 "$t" "$mutmut" run --max-children "$children" "$@" | tail -5
}

# mutants and the test statistics, with one mutant (mutmut generates everything on its first run)
step "generate and collect statistics" 'graphborrow.core.runs.x_summarize__mutmut_1'
mapfile -t names < <(python scripts/mutation_sample.py "${sample[@]}")
echo "sample: ${#names[@]} mutants not yet checked"
[ ${#names[@]} -gt 0 ] && step "the sample" "${names[@]}"
step "every other mutant" "${patterns[@]}"
"$mutmut" results --all true | awk -F': ' '{n[$NF]++} END {for (s in n) print s": "n[s]}'
