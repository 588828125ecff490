#!/usr/bin/env bash
# The whole GPU suite as issue 32 asks it to pass: `pytest -m cuda -n 6 --dist loadfile tests/`, run
# after run on this machine until RUNS have passed in a row (a failure ends the call, exit 1, and the
# next call starts the row over), within $SUITE_BUDGET seconds (default 560: a lent GPU's call); a
# run that would not fit ends the call (exit 0): the machine's first run needs $SUITE_COLD_S (default
# 450: it compiles and tunes), a later one $SUITE_WARM_S if set, else 1.2x the longest warm run
# this machine has finished (its seconds kept in $SUITE_STATE.warm), else 240. A run the budget cuts off neither
# passes nor fails: the row stays as it was (exit 0). The row is counted in $SUITE_STATE (default
# .gpu_cache/suite_row, git-ignored) with a hash of the tree's Python files, so the next call on the
# same warm machine continues it while the code is the same, and starts over where it is not. Each
# run's per-test seconds go to $OUT/suiteN.times (for scripts/gpu_test_seconds.py), its last lines to
# $OUT/suiteN.tail, and fla's autotune choices to $SUITE_STATE.fla/suiteN/ (scripts/fla_configs.py merge).
# Before a cold machine's first run every expert store in /dev/shm is removed (scripts/expert_store.py).
#   bash scripts/gpu_suite.sh [RUNS]        RUNS default 3
set -uo pipefail
runs=${1:-3}
out=${OUT:-/tmp/sluice-gpu}; mkdir -p "$out"
state=${SUITE_STATE:-.gpu_cache/suite_row}; mkdir -p "$(dirname "$state")"
budget=${SUITE_BUDGET:-560}; start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
# seconds the next run may take: a cold machine's first run, else a warm one's (the longest seen, with room)
run_needs() {
  if [ ! -e "$state.warm" ]; then echo "${SUITE_COLD_S:-450}"; return; fi
  local longest; longest=$(sort -n "$state.warm" | tail -1)
  echo "${SUITE_WARM_S:-$([ -n "$longest" ] && echo $(( longest * 6 / 5 )) || echo 240)}"
}
export PYTHONUNBUFFERED=1
tree=$(find frontend scheduler worker moe_offload tests -name '*.py' | sort | xargs cat | md5sum | cut -c1-12)
row=0; read -r kept_row kept_tree 2>/dev/null < "$state" && [ "$kept_tree" = "$tree" ] && row=$kept_row
while [ "$row" -lt "$runs" ]; do
  n=$(( row + 1 )); need=$(run_needs)
  if [ "$(left)" -lt "$need" ]; then echo "suite: $row of $runs in a row; run $n needs ~$need s, $(left) s left"; exit 0; fi
  t0=$(date +%s)
  # a cold machine's stores are other commands' (a served session's): they take host memory the suite's own
  # stores need (a worker died beside 16 GB of them, H100, 2026-12-07), so they go; a warm one keeps the suite's
  if [ ! -e "$state.warm" ]; then python scripts/expert_store.py remove --all; fi
  # expert stores outlive a killed worker (its session never removes them): say how full /dev/shm is
  echo "suite run $n: /dev/shm $(df -h --output=used,size /dev/shm | tail -1 | xargs) used before it"
  SLUICE_TEST_LOG=$out/suite$n.times SLUICE_FLA_DUMP=$state.fla/suite$n timeout $(( $(left) - 10 )) \
    python -m pytest -m cuda -n 6 --dist loadfile -q -p no:cacheprovider tests/ > "$state.log" 2>&1
  rc=$?
  tail -30 "$state.log" > "$out/suite$n.tail"
  echo "suite run $n: rc=$rc in $(( $(date +%s) - t0 )) s: $(tail -1 "$state.log")"
  if [ $rc = 124 ]; then  # not counted; on a warm machine its seconds are the least such a run takes
    [ -e "$state.warm" ] && echo $(( $(date +%s) - t0 )) >> "$state.warm"
    echo "suite: run $n cut off by the budget, not counted; $row of $runs in a row"; exit 0
  fi
  # this machine's Triton and fla caches are filled; a warm run's seconds size the next one
  if [ -e "$state.warm" ]; then echo $(( $(date +%s) - t0 )) >> "$state.warm"; else touch "$state.warm"; fi
  [ $rc = 0 ] && row=$n || row=0
  echo "$row $tree" > "$state"
  if [ $rc != 0 ]; then grep -E "^(FAILED|ERROR)|crashed" "$state.log" | head -20; exit 1; fi
done
echo "suite: $row of $runs in a row"
