#!/usr/bin/env bash
# Train: `bash scripts/train.sh [--config NAME] [--section.key=value ...]`; default llama3_debug.
# With NPROC=N set, runs N processes through torchrun on this machine.
# Runs in the folder it was called from (the set-up moves to the repository), so relative paths
# (data.path, job.dump_folder, a reward module beside your data) mean what they say there.
HERE="$PWD"
source "$(dirname "$0")/_venv.sh"
cd "$HERE"
case " $* " in *" --config"*) ;; *) set -- --config llama3_debug "$@" ;; esac
if [ "${NPROC:-1}" -gt 1 ]; then
    # titan-launch rather than a bare torchrun: importing torch in the launcher process loads
    # torch_tpu, which leaves TORCH_DEVICE_BACKEND_AUTOLOAD=1 set for the workers, so each would load
    # it again (seconds of CPU and libtpu's log lines) on a host without TPU chips; titan-launch
    # decides that before torch is imported, for itself and the workers.
    exec python -m titan_tpu.launch --nproc-per-node="$NPROC" "$ROOT/train.py" "$@"
fi
exec python "$ROOT/train.py" "$@"
