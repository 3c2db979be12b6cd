"""The import layering of docs/architecture.md, checked on the source with `ast` (nothing is imported).

Each rule names a layer (files, by glob from the repository root), the modules it must not import, and
why. Every import statement counts: at the top, inside a function, under `if TYPE_CHECKING:`, and
`importlib.import_module("literal")`; relative imports are resolved first. A rule whose files match
nothing fails too, so renaming a folder cannot switch a rule off without anyone noticing.
"""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import REPO

# Everything the engine has above the configuration and the shared interfaces, for "nothing of it"
# rules.
_ENGINE = (
    "titan_tpu.device",
    "titan_tpu.distributed",
    "titan_tpu.data",
    "titan_tpu.checkpoint",
    "titan_tpu.metrics",
    "titan_tpu.optim",
    "titan_tpu.autotune",
    "titan_tpu.generation",
    "titan_tpu.environments",
    "titan_tpu.tasks",
    "titan_tpu.training",
    "titan_tpu.lora",
)
_ENTRY_POINTS = ("titan_tpu.plan", "titan_tpu.launch", "titan_tpu.doctor", "titan_tpu.dryrun")

# Everything of titan_tpu but the models (test_every_part_of_the_package_is_in_a_layer keeps it whole).
_OUTSIDE_MODELS = ("titan_tpu.config", "titan_tpu.protocols", *_ENGINE, *_ENTRY_POINTS)

# The config sections a family or a task owns (titan_tpu/config/catalogue.py), the torch-free modules
# a task's section keeps beside it (its checks: config_*.py), and the package doors the loader passes
# through to reach them.
_SECTION_MODULES = ("titan_tpu/tasks/*/config.py", "titan_tpu/tasks/*/config_*.py", "titan_tpu/models/*/config.py")
_DOORS = (
    "titan_tpu/models/__init__.py",
    "titan_tpu/models/*/__init__.py",
    "titan_tpu/tasks/__init__.py",
    "titan_tpu/tasks/*/__init__.py",
    "titan_tpu/training/__init__.py",
)


def _engine_except(*layers: str) -> tuple[str, ...]:
    return tuple(name for name in _ENGINE if name not in layers)


@dataclass(frozen=True)
class Rule:
    layer: str
    files: tuple[str, ...]  # globs relative to the repository root
    forbidden: tuple[str, ...]  # module prefixes: "torch.distributed" also forbids its submodules
    why: str
    exempt: tuple[str, ...] = ()
    no_private_names: bool = False  # no `_name` (or `_module`) from titan_tpu, but its own package's
    allowed: tuple[str, ...] = ()  # module prefixes inside a forbidden one that the layer may import
    siblings: tuple[str, ...] = ()  # module-name globs of the file's own package that the layer may import


RULES = (
    Rule(
        "config",
        ("titan_tpu/config/**/*.py",),
        ("torch", "numpy", "titan_tpu.models", "titan_tpu.protocols", *_ENGINE, *_ENTRY_POINTS),
        "the ground floor: `train.py --help` and the plain config errors answer before torch loads, "
        "and every layer reads it; the entry points check registry names after loading",
    ),
    Rule(
        "owned sections",
        _SECTION_MODULES,
        ("torch", "numpy", "titan_tpu"),
        "a family's or a task's section is read by the config loader with the core ones, before torch "
        "loads: it is made of the configuration's helpers alone, and of its package's config.py and "
        "config_*.py modules (a task's checks of its section, under this same rule)",
        allowed=("titan_tpu.config",),
        siblings=("config", "config_*"),
    ),
    Rule(
        "package doors",
        _DOORS,
        ("torch", "numpy", "transformers", "titan_tpu"),
        "the loader reaches a section module through its packages' doors, the registries list families "
        "and tasks without loading them, and the planner reads the config's names without the trainer: "
        "a door loads nothing",
    ),
    Rule(
        "protocols",
        ("titan_tpu/protocols/**/*.py",),
        ("titan_tpu.models", *_ENGINE, *_ENTRY_POINTS),
        "the shared interfaces sit at the bottom, above the configuration only: the engine and the "
        "families both depend on them, so they may depend on neither",
    ),
    Rule(
        "model code",
        ("titan_tpu/models/**/*.py",),
        ("torch.distributed", *(name for name in _OUTSIDE_MODELS if name != "titan_tpu.protocols")),
        "model files are single-device; parallelism is applied from outside by parallelize.py; they "
        "implement the shared interfaces (titan_tpu.protocols) and know nothing else of the engine",
        exempt=(
            "titan_tpu/models/registry.py",
            "titan_tpu/models/*/parallelize.py",
            "titan_tpu/models/*/config.py",
        ),
    ),
    Rule(
        "titan_tpu.models",
        ("titan_tpu/models/**/*.py",),
        _engine_except("titan_tpu.distributed"),
        "the engine finds models through the registry, never the other way round; a family's "
        "parallelize.py may use titan_tpu.distributed's building blocks",
    ),
    Rule(
        "device",
        ("titan_tpu/device/**/*.py",),
        ("titan_tpu.models", *_engine_except("titan_tpu.device")),
        "the bottom of the engine: everything else asks it about the hardware",
    ),
    Rule(
        "distributed",
        ("titan_tpu/distributed/**/*.py",),
        ("titan_tpu.models", *_engine_except("titan_tpu.device", "titan_tpu.distributed")),
        "meshes, FSDP, TP, EP work on any nn.Module handed in; they know no model, data or loop; a LoRA "
        "adapter's factors are placed and drawn by titan_tpu/lora/placement.py, which knows only the layer",
        allowed=("titan_tpu.lora.placement",),
    ),
    Rule(
        "lora",
        ("titan_tpu/lora/**/*.py",),
        (
            "titan_tpu.models",
            *_engine_except("titan_tpu.device", "titan_tpu.distributed", "titan_tpu.checkpoint", "titan_tpu.lora"),
        ),
        "LoRA on the engine's side swaps, places and exports the adapter layer (titan_tpu.models.common.lora) "
        "on any model handed in, and counts its FLOPs by the shared convention (titan_tpu.models.common.flops); "
        "it knows no family, task, data or loop",
        allowed=("titan_tpu.models.common.lora", "titan_tpu.models.common.flops"),
    ),
    Rule(
        "lora placement",
        ("titan_tpu/lora/placement.py",),
        ("titan_tpu.models", *_ENGINE),
        "the distributed layer calls it while it parallelises and initialises a model: it may know the "
        "adapter layer and nothing of the engine",
        allowed=("titan_tpu.models.common.lora",),
    ),
    Rule(
        "data",
        ("titan_tpu/data/**/*.py",),
        ("torch.distributed", "titan_tpu.models", *_engine_except("titan_tpu.data")),
        "the pipeline gets its data-parallel rank and size as plain ints, so it runs and is "
        "tested without a process group",
    ),
    Rule(
        "data: source contract",
        ("titan_tpu/data/documents.py",),
        ("titan_tpu.data.sources", "titan_tpu.data.files", "titan_tpu.data.loader", "titan_tpu.data.packing"),
        "every source depends on the contract, the contract on no source",
    ),
    Rule(
        "data: embedded and Hub sources",
        ("titan_tpu/data/sources.py",),
        ("titan_tpu.data.files", "titan_tpu.data.loader"),
        "sources do not import each other; loader.build_source picks one",
    ),
    Rule(
        "data: file source",
        ("titan_tpu/data/files.py",),
        ("titan_tpu.data.sources", "titan_tpu.data.loader"),
        "sources do not import each other; loader.build_source picks one",
    ),
    Rule(
        "checkpoint",
        ("titan_tpu/checkpoint/**/*.py",),
        ("titan_tpu.models", *_engine_except("titan_tpu.device", "titan_tpu.distributed", "titan_tpu.checkpoint")),
        "it saves the Stateful objects it is handed and converts through the adapter it is handed",
    ),
    Rule(
        "metrics",
        ("titan_tpu/metrics/**/*.py",),
        ("titan_tpu.models", *_engine_except("titan_tpu.device", "titan_tpu.metrics")),
        "a record in, lines out; the trainer computes what goes into the record",
    ),
    Rule(
        "optim",
        ("titan_tpu/optim.py",),
        ("titan_tpu.models", *_engine_except("titan_tpu.optim")),
        "optimizers and schedules are built from parameters and a config section alone",
    ),
    Rule(
        "autotune",
        ("titan_tpu/autotune/**/*.py",),
        ("titan_tpu.models", *_engine_except("titan_tpu.device", "titan_tpu.autotune")),
        "it times the kernels a model family lists as tunable (titan_tpu.protocols.tunable) on the "
        "device it is handed; it knows no family, data, checkpoint, metrics, optimizer, task or trainer",
    ),
    Rule(
        "generation",
        ("titan_tpu/generation/**/*.py",),
        ("titan_tpu.models", *_engine_except("titan_tpu.device", "titan_tpu.distributed", "titan_tpu.generation")),
        "sampling runs any model through the family's Decoding (titan_tpu.protocols.model_spec) and "
        "serves every task; it knows no family, data, task or trainer",
    ),
    Rule(
        "environments",
        ("titan_tpu/environments/**/*.py",),
        (
            "torch",
            "numpy",
            "titan_tpu.config",
            "titan_tpu.models",
            *_ENTRY_POINTS,
            *_engine_except("titan_tpu.environments"),
        ),
        "an environment sees messages and records only (titan_tpu/protocols/environment.py): the trainer owns "
        "tokens, models and ranks, and a user's environment is written the same way",
    ),
    Rule(
        "tasks",
        ("titan_tpu/tasks/**/*.py",),
        ("titan_tpu.training",),
        "the trainer runs tasks; a task never drives the trainer, and is built from the public pieces "
        "of the engine and the models, never their insides",
        no_private_names=True,
    ),
    Rule(
        "the seam and the loop",
        ("titan_tpu/tasks/base.py", "titan_tpu/training/**/*.py"),
        ("titan_tpu.models",),
        "the trainer and the task seam know a family only as a ModelSpec (titan_tpu.protocols), found "
        "by name in the registry",
        allowed=("titan_tpu.models.registry",),
    ),
    Rule(
        "registered names",
        ("titan_tpu/training/registered_names.py",),
        _engine_except("titan_tpu.training"),
        "it reads the model and task registries' tables and builds nothing, so that every entry point, "
        "the planner included, can check a config's names",
        allowed=("titan_tpu.tasks.registry",),
    ),
    Rule(
        "plan",
        ("titan_tpu/plan/**/*.py",),
        _engine_except("titan_tpu.device", "titan_tpu.distributed") + ("titan_tpu.launch", "titan_tpu.doctor"),
        "the planner reads a config (its names checked like train.py's) and the model's shape, sharded "
        "by the trainer's rules, without building a run: nothing that trains, loads data or "
        "checkpoints, or logs; it asks the run's task for its workload through the task registry, and builds "
        "a LoRA run's adapters as the trainer does (titan_tpu.lora)",
        allowed=("titan_tpu.tasks.registry", "titan_tpu.training.registered_names", "titan_tpu.lora"),
    ),
    Rule(
        "launch",
        ("titan_tpu/launch/**/*.py",),
        ("titan_tpu.models", "titan_tpu.plan", "titan_tpu.doctor", *_engine_except("titan_tpu.device")),
        "the launcher runs on each host before any training process exists; it only asks the device "
        "layer how many devices the host has",
    ),
    Rule(
        "doctor",
        ("titan_tpu/doctor/**/*.py",),
        ("titan_tpu.launch",),
        "the doctor runs the engine's pieces and reads the planner's assumptions; the launcher may start "
        "it, it never starts the launcher",
    ),
    Rule(
        "dryrun",
        ("titan_tpu/dryrun/**/*.py",),
        ("titan_tpu.launch", "titan_tpu.doctor", "titan_tpu.plan"),
        "the dry run is the trainer's own set-up at a simulated world size; the planner is checked "
        "against it from outside (tests, benchmarks), so that neither bends to the other",
    ),
    Rule(
        "leaves",
        ("titan_tpu/**/*.py",),
        ("titan_tpu.plan", "titan_tpu.launch", "titan_tpu.doctor", "titan_tpu.dryrun"),
        "the planner, the launcher, the doctor and the dry run are entry points around the engine; "
        "nothing in it depends on them (the planner reads a doctor report as a file, not through its code)",
        exempt=("titan_tpu/plan/*.py", "titan_tpu/launch/*.py", "titan_tpu/doctor/*.py", "titan_tpu/dryrun/*.py"),
    ),
    Rule(
        "package",
        ("titan_tpu/**/*.py",),
        ("train", "scripts", "tests"),
        "the installed package works without the repository's entry point, scripts and tests",
    ),
    Rule(
        "one import name",
        ("titan_tpu/**/*.py", "train.py", "scripts/**/*.py", "tests/**/*.py"),
        ("models", "train_configs"),
        "the models and the shipped configs are titan_tpu.models and titan_tpu.train_configs; a "
        "top-level `models` is any other project's package",
    ),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[int, str, str]]:
    """(line, imported module, imported name or "") for every import in `source`.

    `from a import b` gives ("a", "b"): b may be a submodule, so rules match "a.b" as well as "a".
    """
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, module, is_package)
            found.extend((node.lineno, target, alias.name) for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value, ""))
    return sorted(found)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _private(target: str, name: str, own_package: str) -> bool:
    if not _within(target, "titan_tpu") or _within(target, own_package):
        return False
    return name.startswith("_") or any(part.startswith("_") for part in target.split("."))


def _sibling(name: str, module: str, patterns: tuple[str, ...]) -> bool:
    """Whether `name` is a module of `module`'s own package whose last part matches one of `patterns`."""
    package, _, last = name.rpartition(".")
    return package == module.rpartition(".")[0] and any(fnmatch.fnmatch(last, p) for p in patterns)


def rule_files(rule: Rule, root: Path) -> list[Path]:
    files = {path for pattern in rule.files for path in root.glob(pattern) if path.is_file()}
    return sorted(
        path for path in files if not any(fnmatch.fnmatch(path.relative_to(root).as_posix(), e) for e in rule.exempt)
    )


def violations(rule: Rule, root: Path) -> list[str]:
    found: list[str] = []
    for path in rule_files(rule, root):
        module = module_name(path, root)
        own_package = ".".join(module.split(".")[:2])
        where = path.relative_to(root).as_posix()
        source = path.read_text("utf-8")
        is_package = path.name == "__init__.py"
        for line, target, name in imports_of(source, module, is_package):
            candidates = [target, f"{target}.{name}"] if name else [target]
            if any(_within(candidate, allowed) for candidate in candidates for allowed in rule.allowed):
                continue
            if any(_sibling(candidate, module, rule.siblings) for candidate in candidates):
                continue
            for prefix in rule.forbidden:
                if any(_within(candidate, prefix) for candidate in candidates):
                    found.append(f"{where}:{line}: {rule.layer} imports {candidates[-1]} ({rule.why})")
                    break
            if rule.no_private_names and _private(target, name, own_package):
                found.append(f"{where}:{line}: {rule.layer} imports private {target} {name} ({rule.why})")
    return found


@pytest.mark.parametrize("rule", RULES, ids=[rule.layer for rule in RULES])
def test_layer_imports_only_what_it_may(rule: Rule) -> None:
    assert rule_files(rule, REPO), f"rule '{rule.layer}' matches no file: {rule.files}"
    assert violations(rule, REPO) == []


def test_every_part_of_the_package_is_in_a_layer() -> None:
    """A new package or module under titan_tpu/ must be named in _ENGINE (or be the config, the
    planner or the launcher), or the rules that forbid "the engine" would not see it."""
    parts = {p.stem for p in (REPO / "titan_tpu").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    named = {name.split(".")[1] for name in _OUTSIDE_MODELS}
    assert parts - {"__init__", "models", "train_configs"} == named


def test_loading_a_config_loads_no_torch_and_no_owner_code() -> None:
    """What the config rules are for, end to end: transitive imports included (a config module that
    imports a torch-free module of a package whose __init__ imports torch still loads torch). Loading
    a config and its --help reads every owned section through its packages' doors and loads nothing
    else of titan_tpu: the bug this catches is a door or a section module that imports its family's or
    task's code (and with it torch), so that every config error waits for torch."""
    # Counted from the import of titan_tpu.config: what the environment's startup hook loaded before
    # (titan_tpu.device.tpu_runtime, see there) is not the config's doing.
    probe = (
        "import sys; before = set(sys.modules)\n"
        "import titan_tpu.config as c\n"
        "c.load_config('grpo_qwen3_debug', []); c.help_text()\n"
        "print(sorted(m for m in set(sys.modules) - before if m in ('torch', 'numpy', 'transformers') "
        "or m.startswith('titan_tpu.') and not m.startswith('titan_tpu.config')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = set(eval(result.stdout))  # noqa: S307 (a list of module names this test printed)
    sections = {module_name(path, REPO) for pattern in _SECTION_MODULES for path in REPO.glob(pattern)}
    doors = {name.rsplit(".", 1)[0] for name in sections} | {"titan_tpu.models", "titan_tpu.tasks"}
    assert sections and loaded == sections | doors


def test_checker_flags_a_synthetic_bad_tree(tmp_path: Path) -> None:
    """Negative control: each way of importing what a layer may not is reported, clean code is not
    (the registry import of training/loop.py, the configuration helper of the toy section and its own
    config_*.py modules; not another module of its package, nor another task's config_*.py). The
    configuration may not import a layer above it even inside a function or from a task's torch-free
    module: only the catalogue names those, as paths."""
    bad = {
        "titan_tpu/models/toy/model.py": "import torch\nfrom torch.distributed.tensor import DTensor\n",
        "titan_tpu/models/toy/args.py": "def f():\n    from titan_tpu import training\n",
        "titan_tpu/models/toy/__init__.py": "from titan_tpu.models.toy.spec import SPEC\n",
        "titan_tpu/tasks/toy/config.py": (
            "from titan_tpu.config.sections import opt\nimport torch\n"
            "from titan_tpu.tasks.toy.config_checks import check\nfrom titan_tpu.tasks.toy import config_more\n"
            "from titan_tpu.tasks.toy.prompts import P\nfrom titan_tpu.tasks.flow.config_checks import check\n"
        ),
        "titan_tpu/tasks/toy/config_checks.py": "from titan_tpu.config.sections import require\nimport numpy\n",
        "titan_tpu/autotune/pick.py": "from titan_tpu.models.common.attention_kernels import attention_kernel\n",
        "titan_tpu/generation/decode.py": "from titan_tpu.models.common.kv_cache import KVCache\n",
        "titan_tpu/training/loop.py": (
            "from titan_tpu.models.registry import get_model_spec\nfrom titan_tpu.models.llama3.model import M\n"
        ),
        "titan_tpu/protocols/spec.py": "from titan_tpu.config.errors import ConfigError\nfrom titan_tpu.data import loader\n",
        "titan_tpu/models/toy/parallelize.py": "from titan_tpu.distributed import fsdp\nfrom titan_tpu.data import loader\n",
        "titan_tpu/models/toy/flops.py": "from titan_tpu.models.common.flops import f\nfrom models.common import g\n",
        "scripts/tool.py": "import torch\nimport models\n",
        "titan_tpu/config/extra.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
        "titan_tpu/config/late.py": (
            "def check():\n    import titan_tpu.models\nclass C:\n    from titan_tpu.tasks import base\n"
            "from titan_tpu.tasks.flow.config import Section\nfrom titan_tpu.tasks.flow.configs import X\n"
        ),
        "titan_tpu/data/documents.py": "from . import sources\n",
        "titan_tpu/data/files.py": "from .sources import text_of\n",
        "titan_tpu/data/pipe.py": "import importlib\nimportlib.import_module('titan_tpu.distributed.fsdp')\n",
        "titan_tpu/device/__init__.py": "from ..metrics.peak import table\n",
        "titan_tpu/tasks/lm.py": "import titan_tpu.training.trainer as t\n",
        "titan_tpu/tasks/grpo/loop.py": "from titan_tpu.data.tokenizer import _bytes\nfrom titan_tpu.tasks.grpo import _ok\n",
        "titan_tpu/plan/names.py": "from titan_tpu.training.registered_names import check\nfrom titan_tpu.tasks import base\n",
        "titan_tpu/metrics/logger.py": "from train import main\n",
    }
    for relative, text in bad.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    reported = {line.split(": ", 1)[0] for rule in RULES for line in violations(rule, tmp_path)}
    assert reported == {
        "titan_tpu/models/toy/model.py:2",
        "titan_tpu/models/toy/args.py:2",
        "titan_tpu/models/toy/parallelize.py:2",
        "titan_tpu/models/toy/flops.py:2",
        "titan_tpu/models/toy/__init__.py:1",
        "titan_tpu/tasks/toy/config.py:2",
        "titan_tpu/tasks/toy/config.py:5",
        "titan_tpu/tasks/toy/config.py:6",
        "titan_tpu/tasks/toy/config_checks.py:2",
        "titan_tpu/autotune/pick.py:1",
        "titan_tpu/generation/decode.py:1",
        "titan_tpu/training/loop.py:2",
        "titan_tpu/protocols/spec.py:2",
        "scripts/tool.py:2",
        "titan_tpu/config/extra.py:3",
        "titan_tpu/config/late.py:2",
        "titan_tpu/config/late.py:4",
        "titan_tpu/config/late.py:5",
        "titan_tpu/config/late.py:6",
        "titan_tpu/data/documents.py:1",
        "titan_tpu/data/files.py:1",
        "titan_tpu/data/pipe.py:2",
        "titan_tpu/device/__init__.py:1",
        "titan_tpu/tasks/lm.py:1",
        "titan_tpu/tasks/grpo/loop.py:1",
        "titan_tpu/plan/names.py:2",
        "titan_tpu/metrics/logger.py:1",
    }


def test_relative_imports_resolve_against_the_package() -> None:
    assert imports_of("from . import x", "titan_tpu.data.loader") == [(1, "titan_tpu.data", "x")]
    assert imports_of("from .. import y", "titan_tpu.data.loader") == [(1, "titan_tpu", "y")]
    assert imports_of("from .a import b", "titan_tpu.data", is_package=True) == [(1, "titan_tpu.data.a", "b")]


def _modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in (root / "titan_tpu").rglob("*.py")}


def test_every_titan_tpu_import_resolves_to_a_file() -> None:
    """A structure drawn from the import lines finds every titan_tpu module at the path its name says,
    in the package, the entry point, the scripts and the tests: `import a.b` and `from a import b` name
    a file (a.py, a/__init__.py) or, for `from`, an attribute of one. The bug this catches: a folder
    installed under another name (as setup.py once installed models/ as titan_tpu.models)."""
    modules = _modules(REPO)
    unresolved = []
    for pattern in ("titan_tpu/**/*.py", "train.py", "scripts/**/*.py", "tests/**/*.py"):
        for path in REPO.glob(pattern):
            module = module_name(path, REPO)
            for line, target, _name in imports_of(path.read_text("utf-8"), module, path.name == "__init__.py"):
                if _within(target, "titan_tpu") and target not in modules:
                    unresolved.append(f"{path.relative_to(REPO)}:{line}: {target}")
    assert unresolved == []


def _runtime_imports(path: Path, module: str) -> set[tuple[str, str]]:
    """(module, name) of every import that runs (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text("utf-8"))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    return {
        (target, name)
        for line, target, name in imports_of(
            ast.unparse(ast.Module([n for n in tree.body if id(n) not in typing_only], [])),
            module,
            path.name == "__init__.py",
        )
    }


def test_no_import_circle_except_for_type_checking() -> None:
    """The module graph of titan_tpu (an edge for each import that runs, to the module it names) has no
    circle: the layers are a stack, and within a layer nothing imports back up."""
    modules = _modules(REPO)
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for target, name in _runtime_imports(path, module):
            named = f"{target}.{name}" if f"{target}.{name}" in modules else target
            if named in modules and named != module:
                targets.add(named)
        edges[module] = targets
    circles = [sorted(group) for group in _strongly_connected(edges) if len(group) > 1]
    assert circles == []


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def test_circle_finder_sees_a_circle() -> None:
    """Negative control for the circle test."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert sorted(map(sorted, _strongly_connected(edges))) == [["a", "b", "c"], ["d"]]


def test_each_shared_interface_is_defined_once() -> None:
    """Every class of titan_tpu/protocols/ is defined there and nowhere else in the package (the
    StateDictAdapter protocol once stood in two places, because the checkpoint layer could not import
    the models' copy)."""
    interfaces = {
        node.name
        for path in (REPO / "titan_tpu" / "protocols").glob("*.py")
        for node in ast.parse(path.read_text("utf-8")).body
        if isinstance(node, ast.ClassDef)
    }
    elsewhere = [
        f"{path.relative_to(REPO)}: {node.name}"
        for path in (REPO / "titan_tpu").rglob("*.py")
        if "protocols" not in path.parts
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, ast.ClassDef) and node.name in interfaces
    ]
    assert "StateDictAdapter" in interfaces and elsewhere == []
