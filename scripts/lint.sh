#!/usr/bin/env bash
# Style and types, as CI checks them: `bash scripts/lint.sh`. The formatter's check and the linter over
# the repository, the type checker over titan_tpu/ (their settings: pyproject.toml). To apply the
# formatter and the linter's safe fixes instead: `.venv/bin/ruff format . && .venv/bin/ruff check --fix .`
source "$(dirname "$0")/_venv.sh"
ruff format --check .
ruff check .
mypy
