"""Against the installed torch_tpu package (no stand-in): detection without chips, the forced-tpu
error, the compile backend, and every torch_tpu function the project calls, checked by signature
so that a rename in a new release fails here rather than on a TPU.

On a host with TPU device files `import torch` loads torch_tpu (torch's backend autoload); elsewhere
the test set-up switches that off, as the entry points do, and this module imports torch_tpu itself,
which installs `torch.tpu` and without chips renames nothing, so these tests run in the test process.
"""

from __future__ import annotations

import ast
import inspect
import logging
from pathlib import Path

import pytest

torch_tpu = pytest.importorskip("torch_tpu", reason="torch_tpu is not installed (pip install -e '.[tpu]')")

import torch  # noqa: E402

from tests.support.paths import REPO  # noqa: E402
from titan_tpu.config import ConfigError  # noqa: E402
from titan_tpu.device import TORCH_TPU_CALLS, resolve_device_type, torch_tpu_function  # noqa: E402
from titan_tpu.device.tpu_runtime import host_has_tpu_device_files  # noqa: E402
from titan_tpu.distributed.compile import resolve_backend  # noqa: E402

pytestmark = pytest.mark.tpu

ROOT = REPO
PROJECT_SOURCES = ["titan_tpu", "models", "scripts"]
chips_visible = torch.accelerator.current_accelerator(check_available=True) is not None
needs_no_chip = pytest.mark.skipif(chips_visible, reason="this host has an accelerator; the no-chip path cannot run")
needs_no_tpu_host = pytest.mark.skipif(host_has_tpu_device_files(), reason="this host has TPU device files")


def torch_tpu_version() -> str:
    from importlib.metadata import version

    return version("torch-tpu")


@needs_no_chip
@needs_no_tpu_host
def test_auto_falls_back_to_cpu_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="titan_tpu.device"):
        assert resolve_device_type("auto") == "cpu"
    assert [r.getMessage() for r in caplog.records] == [
        f"device: torch_tpu {torch_tpu_version()} is installed but this host has no TPU device files "
        "(/dev/accel[0-9]*, /dev/vfio/[0-9]*); using the CPU"
    ]


@needs_no_chip
@needs_no_tpu_host
def test_forced_tpu_without_chips_is_one_config_error() -> None:
    with pytest.raises(ConfigError, match=r"device.type = 'tpu' was requested but .* has no TPU device files"):
        resolve_device_type("tpu")


def test_torch_tpu_refuses_its_internal_device_functions() -> None:
    """The premise of the device layer: these raise from user code, so it must go through
    torch.accelerator. If a release makes them public again, this documents the change."""
    for name in ("device_count", "is_available"):
        with pytest.raises(RuntimeError, match=f"Use torch.accelerator.{name} instead"):
            getattr(torch.tpu, name)()


@pytest.mark.parametrize("path", sorted(TORCH_TPU_CALLS))
def test_every_called_function_exists_with_the_keywords_we_pass(path: str) -> None:
    if path == "torch.tpu.ops.splash_sdpa":
        pytest.importorskip("jax", reason="torch_tpu's splash kernel imports jax, which the tpu extra leaves out")
    parameters = inspect.signature(torch_tpu_function(path)).parameters
    missing = [name for name in TORCH_TPU_CALLS[path] if name not in parameters]
    assert not missing, f"{path}{inspect.signature(torch_tpu_function(path))} lacks {missing}"


def test_topology_mesh_and_launch_env_take_options_by_keyword() -> None:
    """The call forms the mesh and the launcher use: mesh_shape positional, the rest keywords."""
    mesh = inspect.signature(torch_tpu_function("torch.tpu.distributed.topology_aware_mesh"))
    mesh.bind((2, 4), dcn_mesh_shape=(2, 1), allow_split_physical_axes=True)
    launch = inspect.signature(torch_tpu_function("torch.tpu.distributed.set_tpu_launch_env"))
    launch.bind(nnodes=2, nproc_per_node=4)
    with pytest.raises(TypeError):
        launch.bind(2, 4)  # negative control: the keyword-only rule is real


def test_device_properties_report_memory_per_device() -> None:
    properties = inspect.signature(torch_tpu_function("torch.tpu.get_device_properties")).return_annotation
    fields = properties.__dataclass_fields__ if not isinstance(properties, str) else {}
    assert "total_memory" in fields and "name" in fields


def test_unlisted_functions_are_refused() -> None:
    with pytest.raises(KeyError, match="not in TORCH_TPU_CALLS"):
        torch_tpu_function("torch.tpu.device_count")


def _torch_tpu_references(path: Path) -> set[str]:
    """Dotted `torch.tpu...` names in a Python file's code (not its comments or strings)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute):
            parts: list[str] = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch" and parts[-1:] == ["tpu"]:
                found.add(".".join(["torch", *reversed(parts)]))
    return found


def test_project_code_names_only_listed_torch_tpu_functions(tmp_path: Path) -> None:
    """Direct `torch.tpu.x(...)` calls anywhere in the project must be in TORCH_TPU_CALLS, so the
    signature test above covers them."""
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\n# torch.tpu.in_a_comment()\ntorch.tpu.device_count()\n")
    assert _torch_tpu_references(planted) == {"torch.tpu", "torch.tpu.device_count"}  # the scan sees calls
    files = [path for source in PROJECT_SOURCES for path in (ROOT / source).rglob("*.py")] + [ROOT / "train.py"]
    references = {ref for path in files for ref in _torch_tpu_references(path)}
    modules = {path.rpartition(".")[0] for path in TORCH_TPU_CALLS}
    unlisted = sorted(ref for ref in references if ref not in TORCH_TPU_CALLS and ref not in modules | {"torch.tpu"})
    assert not unlisted, f"add these to titan_tpu/device/tpu_api.py TORCH_TPU_CALLS: {unlisted}"


def test_compile_backend_is_the_one_torch_tpu_registers() -> None:
    assert resolve_backend("auto", "tpu") == "tpu"
    with pytest.raises(ConfigError, match="compile.backend = 'inductor' does not run on tpu"):
        resolve_backend("inductor", "tpu")
