#!/usr/bin/env bash
# Run the whole test suite (unit, parity, engine, multi-process on CPU): `bash scripts/test.sh`.
# With arguments it is pytest with them: `bash scripts/test.sh -m "not slow"`, a path, `-k NAME`.
#
# The whole suite runs in two phases, so that a 2-core machine is kept busy (tests/README.md):
#   1. two pytest processes side by side, one OpenMP thread each (more would only spin against each
#      other): in the foreground the unit tests and then the parity tests but the whole SFT learning
#      run (SFT_LEARNING); in the background the engine tests, which mostly wait (on pip creating the
#      engine's environment the first time, on a vLLM server held to one core), then the SFT learning
#      run, which evens out the two sides; the background's output is printed when it ends;
#   2. the multi-process tests (tests/distributed/), each launch on every core.
# The exit status is the first non-zero one of the four runs (pytest's 5, nothing collected, included).
# Every test file lives under one of the three folders (tests/unit/repository/test_test_tiers.py).
source "$(dirname "$0")/_venv.sh"
if [ $# -gt 0 ]; then
    exec python -m pytest -q "$@"
fi

SFT_LEARNING=tests/parity/tasks/test_sft_learning.py
beside_log="$(mktemp)"
beside_tmp="$(mktemp -d)"
# Its own temporary folders and no cache: two pytest processes would otherwise share both.
beside_pytest() {
    local name="$1"
    shift
    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider --basetemp="$beside_tmp/$name" "$@"
}
(
    engine_status=0
    learning_status=0
    beside_pytest engine -m engine tests || engine_status=$?
    beside_pytest learning -m "not engine" "$SFT_LEARNING" || learning_status=$?
    [ "$engine_status" -eq 0 ] || exit "$engine_status"
    exit "$learning_status"
) >"$beside_log" 2>&1 &
beside=$!

statuses=()
OMP_NUM_THREADS=1 python -m pytest -q -m "not engine" --ignore="$SFT_LEARNING" tests/unit tests/parity || statuses+=($?)
beside_status=0
wait "$beside" || beside_status=$?
echo "----- engine tests, then the SFT learning run (run beside the other tests) -----"
cat "$beside_log"
rm -rf "$beside_log" "$beside_tmp"
[ "$beside_status" -eq 0 ] || statuses+=("$beside_status")
python -m pytest -q tests/distributed || statuses+=($?)
exit "${statuses[0]:-0}"
