#!/usr/bin/env bash
# Run the whole test suite (unit, parity, engine, multi-process on CPU): `bash scripts/test.sh`.
# With arguments it is pytest with them: `bash scripts/test.sh -m "not slow"`, a path, `-k NAME`.
#
# The whole suite runs in two phases, so that a 2-core machine is kept busy (tests/README.md):
#   1. two pytest processes side by side: the engine tests (a vLLM server on one core, its environment
#      created on first use, mostly waiting) then the parity tests, in the background, their output
#      printed when they end; and the unit tests in the foreground;
#   2. the multi-process tests (tests/distributed/), alone: each launch takes every core.
# The exit status is the first non-zero one of the four runs (pytest's 5, nothing collected, included).
# Every test file lives under one of those three folders (tests/unit/repository/test_test_tiers.py).
source "$(dirname "$0")/_venv.sh"
if [ $# -gt 0 ]; then
    exec python -m pytest -q "$@"
fi

side_log="$(mktemp)"
side_tmp="$(mktemp -d)"
# Its own temporary folder and no cache: two pytest processes would otherwise share both.
(
    engine_status=0 parity_status=0
    python -m pytest -q -p no:cacheprovider --basetemp="$side_tmp/engine" -m engine tests || engine_status=$?
    python -m pytest -q -p no:cacheprovider --basetemp="$side_tmp/parity" tests/parity || parity_status=$?
    [ "$engine_status" -eq 0 ] || exit "$engine_status"
    exit "$parity_status"
) >"$side_log" 2>&1 &
side=$!

statuses=()
python -m pytest -q -m "not engine" tests/unit || statuses+=($?)
side_status=0
wait "$side" || side_status=$?
echo "----- engine and parity tests (run beside the unit tests) -----"
cat "$side_log"
rm -rf "$side_log" "$side_tmp"
[ "$side_status" -eq 0 ] || statuses+=("$side_status")
python -m pytest -q tests/distributed || statuses+=($?)
exit "${statuses[0]:-0}"
