#!/usr/bin/env bash
# Run the whole test suite (unit, parity, engine, multi-process on CPU): `bash scripts/test.sh`.
# With arguments it is pytest with them: `bash scripts/test.sh -m "not slow"`, a path, `-k NAME`.
#
# The whole suite runs in three phases, so that a 2-core machine is kept busy (tests/README.md):
#   1. two pytest processes side by side, one OpenMP thread each (more would only spin against each
#      other): the unit tests in the foreground, and in the background the engine tests, which mostly
#      wait (on pip creating the engine's environment the first time, on a vLLM server held to one
#      core), their output printed when they end;
#   2. the parity tests (a whole SFT run among them), on every core;
#   3. the multi-process tests (tests/distributed/), each launch on every core.
# The exit status is the first non-zero one of the four runs (pytest's 5, nothing collected, included).
# Every test file lives under one of the three folders (tests/unit/repository/test_test_tiers.py).
source "$(dirname "$0")/_venv.sh"
if [ $# -gt 0 ]; then
    exec python -m pytest -q "$@"
fi

engine_log="$(mktemp)"
engine_tmp="$(mktemp -d)"
# Its own temporary folder and no cache: two pytest processes would otherwise share both.
OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider --basetemp="$engine_tmp" -m engine tests \
    >"$engine_log" 2>&1 &
engine=$!

statuses=()
OMP_NUM_THREADS=1 python -m pytest -q -m "not engine" tests/unit || statuses+=($?)
engine_status=0
wait "$engine" || engine_status=$?
echo "----- engine tests (run beside the unit tests) -----"
cat "$engine_log"
rm -rf "$engine_log" "$engine_tmp"
[ "$engine_status" -eq 0 ] || statuses+=("$engine_status")
python -m pytest -q tests/parity || statuses+=($?)
python -m pytest -q tests/distributed || statuses+=($?)
exit "${statuses[0]:-0}"
