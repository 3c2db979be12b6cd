"""Which packages the distribution installs; everything else about it is in pyproject.toml.

The repository keeps `models/` and `train_configs/` at its root, where a newcomer looks first, but
installs them inside the one import name it owns: `titan_tpu.models` and `titan_tpu.train_configs`.
A top-level `models` would collide with any other project's package of that name. pyproject.toml's
`packages.find` cannot rename a folder, hence this file.
"""

from setuptools import find_packages, setup

RENAMED = {"titan_tpu.models": "models", "titan_tpu.train_configs": "train_configs"}

setup(
    packages=[
        *find_packages(include=["titan_tpu", "titan_tpu.*"]),
        *(f"titan_tpu.{name}" for name in find_packages(include=["models", "models.*"])),
        "titan_tpu.train_configs",
    ],
    package_dir=RENAMED,
    package_data={"titan_tpu.train_configs": ["*.toml"]},
)
