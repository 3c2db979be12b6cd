"""Write the JobSet that trains a config on N GKE TPU slices, as YAML on stdout.

    python scripts/gke/render_jobset.py --accelerator tpu-v6e-slice --topology 4x4 --slices 2 \\
        --image IMAGE --config llama3_70b --dump-folder gs://BUCKET/run [--section.key=value ...] \\
        | kubectl apply -f -

Arguments it does not know are `--section.key=value` overrides for train.py. The image must hold the
repository (train.py in its working directory) with titan_tpu installed, so `titan-launch` is on
PATH. A gs:// dump folder is mounted with GKE's Cloud Storage FUSE CSI driver; the pods' service
account (--service-account) needs read and write access to the bucket.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from titan_tpu.config import ConfigError  # noqa: E402
from titan_tpu.launch.jobset import JobSetRequest, render_jobset  # noqa: E402
from titan_tpu.launch.slices import ACCELERATORS  # noqa: E402


class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors as the one `error: ...` line every CLI here prints, exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", required=True, help=f"one of: {', '.join(ACCELERATORS)}")
    parser.add_argument("--topology", required=True, help="the slice's chip grid, e.g. 4x4 or 2x2x2")
    parser.add_argument("--slices", type=int, default=1, help="number of slices (default 1)")
    parser.add_argument("--image", required=True, help="container image with the repository and titan_tpu")
    parser.add_argument("--config", required=True, help="train config name, e.g. llama3_70b")
    parser.add_argument("--dump-folder", required=True, help="gs://BUCKET/PATH or an absolute shared path")
    parser.add_argument("--name", default=None, help="JobSet name (default: the config name with '-')")
    parser.add_argument("--max-restarts", type=int, default=3, help="JobSet restarts of all pods (default 3)")
    parser.add_argument(
        "--launcher-restarts", type=int, default=3, help="titan-launch restarts within a pod (default 3)"
    )
    parser.add_argument(
        "--chips-per-host", type=int, default=None, help="for a v5e/v6e 2x4: 8 (one host) or 4 (two hosts)"
    )
    parser.add_argument("--service-account", default=None, help="Kubernetes service account of the pods")
    return parser


def main(argv: list[str]) -> int:
    opts, overrides = _parser().parse_known_args(argv)
    request = JobSetRequest(
        name=opts.name or opts.config.replace("_", "-").lower(),
        accelerator=opts.accelerator,
        topology=opts.topology,
        slices=opts.slices,
        image=opts.image,
        config=opts.config,
        dump_folder=opts.dump_folder,
        overrides=tuple(arg for arg in overrides if arg != "--"),
        max_restarts=opts.max_restarts,
        launcher_restarts=opts.launcher_restarts,
        chips_per_host=opts.chips_per_host,
        service_account=opts.service_account,
    )
    try:
        manifest, shape = render_jobset(request)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"# {request.slices} x {shape.accelerator} {shape.topology}: {shape.hosts} host(s) of "
        f"{shape.chips_per_host} chips ({shape.machine_type}) per slice, {request.slices * shape.chips} chips"
    )
    print(yaml.safe_dump(manifest, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
