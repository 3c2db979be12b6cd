#!/usr/bin/env bash
# Train: `bash scripts/train.sh [--config NAME] [--section.key=value ...]`; default llama3_debug.
# With NPROC=N set, runs N processes through torchrun on this machine.
source "$(dirname "$0")/_venv.sh"
case " $* " in *" --config"*) ;; *) set -- --config llama3_debug "$@" ;; esac
if [ "${NPROC:-1}" -gt 1 ]; then
    exec torchrun --standalone --nproc_per_node="$NPROC" train.py "$@"
fi
exec python train.py "$@"
