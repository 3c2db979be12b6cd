#!/usr/bin/env bash
# Run the whole test suite (unit, parity, multi-process on CPU): `bash scripts/test.sh [pytest args]`.
source "$(dirname "$0")/_venv.sh"
exec python -m pytest -q "$@"
