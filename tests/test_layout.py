"""The package's layers import only downward: tools -> megatron_lm -> megatron -> ops -> runtime.

Every ``import`` and ``from ... import`` in ``megatron_metp`` (module level or inside functions) is
resolved to the layer it names; a module may import its own layer or one below it, never above.
The ``python -m`` entry points at the package root (``demo``, ``cli``, ``compare``, ``dry_run``)
sit above everything; the root ``__init__`` exports the runtime's public names only.
"""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "megatron_metp"
LAYERS = ["runtime", "ops", "megatron", "megatron_lm", "tools"]
ENTRY_POINTS = {"demo", "cli", "compare", "dry_run"}


def layer_of(module: str):
    """Rank of a dotted module name inside the package (None outside it); entry points on top."""
    parts = module.split(".")
    if parts[0] != "megatron_metp":
        return None
    if len(parts) == 1:
        return -1  # the package root: what it may import is checked on its own
    if parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    if parts[1] in ENTRY_POINTS:
        return len(LAYERS)
    raise AssertionError(f"{module}: not in a layer ({', '.join(LAYERS)}) nor an entry point")


def imported_modules(source: str, module: str, is_package: bool):
    """The dotted names a module's source imports (relative imports resolved)."""
    package = module if is_package else module.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names.append(target)
            # ``from . import x`` / ``from .. import x`` import submodules by name
            if not node.module:
                names += [f"{target}.{a.name}" for a in node.names]
    return names


def module_exists(module: str) -> bool:
    """Whether a dotted ``megatron_metp...`` name is a module or package of the tree."""
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def missing_imports(source: str, module: str, is_package: bool = False):
    """Package-internal imports that name no module of the tree (a relative import left pointing
    at a module's old place); ``from pkg import name`` may name an attribute of ``pkg``."""
    bad = []
    for name in imported_modules(source, module, is_package):
        if not name.startswith("megatron_metp") or module_exists(name):
            continue
        parent = name.rsplit(".", 1)[0]
        if module_exists(parent) and (ROOT.parent.joinpath(*parent.split(".")) / "__init__.py"
                                      ).is_file():
            continue  # ``from .package import attribute``
        bad.append((module, name))
    return bad


def upward_imports(source: str, module: str, is_package: bool = False):
    """(importer, imported) pairs where a module imports a layer above its own."""
    own = layer_of(module)
    bad = []
    for name in imported_modules(source, module, is_package):
        other = layer_of(name)
        if other is None or other == -1:
            continue
        if own == -1:
            if other != LAYERS.index("runtime"):
                bad.append((module, name))
        elif other > own:
            bad.append((module, name))
    return bad


def package_modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        yield ".".join(parts), is_package, path.read_text()


def test_imports_point_only_downward():
    modules = list(package_modules())
    assert len(modules) > 60  # the walk found the package
    bad = [pair for name, pkg, src in modules for pair in upward_imports(src, name, pkg)]
    assert bad == [], f"upward imports: {bad}"


def test_every_import_names_a_module_of_the_tree():
    bad = [pair for name, pkg, src in package_modules() for pair in missing_imports(src, name, pkg)]
    assert bad == [], f"imports of modules that do not exist: {bad}"
    # negative control: the import that once pointed from the runtime at a module above it
    assert missing_imports("from .megatron.checkpoint_errors import CheckpointError",
                           "megatron_metp.runtime.watchdog") != []


def test_every_module_is_in_a_layer():
    for name, _, _ in package_modules():
        layer_of(name)


def test_the_old_flat_modules_are_gone():
    for name in ["groups", "ring", "watchdog", "agree", "finite", "offload", "cpu",
                 "megatron_lm_cpu", "megatron_lm_resume"]:
        assert not (ROOT / f"{name}.py").exists(), name
    # the Hugging Face converter is one package, tools/hf/, one module per concern
    for name in ["hf", "hf_checkpoint", "hf_config", "hf_families", "hf_from_args", "hf_keys",
                 "hf_layout", "hf_moe", "hf_moe_layout", "hf_output", "hf_tokenizer_export",
                 "hf_versions", "hf_weights_check", "hf_yarn"]:
        assert not (ROOT / "tools" / f"{name}.py").exists(), name
    assert (ROOT / "tools" / "hf" / "__init__.py").is_file()


@pytest.mark.parametrize("module, source, expected", [
    ("megatron_metp.ops.mlp", "from ..megatron.groups import METPGroups", 1),
    ("megatron_metp.runtime.ring", "from megatron_metp.ops import metp_mlp", 1),
    ("megatron_metp.megatron.spec", "from .. import megatron_lm", 1),
    ("megatron_metp.megatron.spec", "from ..ops import metp_mlp\nfrom ..runtime import agree", 0),
    ("megatron_metp.tools.cli", "from ..megatron_lm import hooks", 0),
])
def test_negative_controls(module, source, expected):
    assert len(upward_imports(source, module)) == expected


def test_public_names_keep_working():
    import megatron_metp
    import megatron_metp.megatron_lm as mlm
    import megatron_metp.ops as ops
    assert megatron_metp.METPGroup.__module__ == "megatron_metp.runtime.groups"
    import megatron_metp.tools.hf as hf
    assert hf.import_hf.__module__ == "megatron_metp.tools.hf.convert"
    assert hf.main.__module__ == "megatron_metp.tools.hf.cli"
    for name in hf.__all__:
        assert callable(getattr(hf, name)), name
    for path in sorted((ROOT / "tools" / "hf").glob("[!_]*.py")):  # each imports (the relative
        importlib.import_module(f"megatron_metp.tools.hf.{path.stem}")  # imports resolve)
    for name in ["metp_mlp", "metp_attention", "ring_attention", "metp_embedding",
                 "metp_output_cross_entropy"]:
        assert callable(getattr(ops, name))
    # the names patches/ calls
    patch_text = "".join(p.read_text() for p in (ROOT.parent / "patches").rglob("*.patch"))
    for name in ["validate_metp_args", "metp_expert_model_parallel_size", "wrap_gpt_builder",
                 "compose_extra_args_providers", "add_metp_args", "route_model_provider"]:
        assert name in patch_text
        assert callable(getattr(mlm, name))
