"""The package's layers import only downward: tools -> megatron_lm -> megatron -> ops -> runtime.

Every ``import`` and ``from ... import`` in ``megatron_metp`` (module level or inside functions) is
resolved to the layer it names; a module may import its own layer or one below it, never above.
The ``python -m`` entry points at the package root (``demo``, ``cli``, ``compare``, ``dry_run``)
sit above everything; the root ``__init__`` exports the runtime's public names only.

Two more rules read the same imports (``read_package``):

* **No import circle across files.** The import graph has an edge from a module to each module of
  the package that importing it runs: ``import p.q.m`` and ``from p.q import m`` (``m`` a
  submodule) run ``p/q/m.py``; ``from p.q import name`` (``name`` no submodule) runs
  ``p/q/__init__.py``. Importing ``p.q.m`` first runs each package ``__init__`` on the way
  (``p/q/__init__.py``), except the packages that hold the importer: Python has begun those
  before it, so a module's ``from .sibling import f`` is no edge to its own ``__init__``, while
  ``from . import name`` taking a name the ``__init__`` defines or re-exports is. Any strongly
  connected set of two or more files fails, lazy imports inside functions included, a package
  ``__init__`` included (one that re-exports its children closes a circle only when one of those
  children imports from it): an import circle is what a lazy import hides, and each such pair of files is
  one concern split in two or two concerns that lean on each other; the shared piece belongs in a
  module both import.
* **No private name from another module.** ``from .m import _x``, ``m._x`` or
  ``getattr(m, "_x")`` on an imported module of the package, for any ``_x`` but a dunder, is
  refused: a name used by another module is public (rename it), or belongs in that module (move
  it). A private *module* ``p/_m.py`` is internal to package ``p``: ``p/__init__.py`` and the
  modules inside ``p`` (at any depth) may import it, modules of other packages may not. Third-party private names are out of
  scope.
"""

import ast
import functools
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


# --- import circles and private names -------------------------------------------------------------
#
# Both checks read every module of a package (module-level and lazy imports inside functions alike,
# absolute and relative) into the same records; ``read_package`` takes any package folder, so the
# negative controls run the checks on small packages written to a temporary folder.


def read_package(root: pathlib.Path):
    """{dotted module name: (is_package, parsed source)} for every ``.py`` file under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (is_package, ast.parse(
            path.read_text(), str(path)))
    return modules


def is_private(name: str) -> bool:
    """``_x`` is private to the module that defines it; ``__x__`` (dunder) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def import_records(modules, module: str):
    """The package-internal imports of ``module``: (line, target module, taken name or None, bound
    name or None) for each imported module; a ``from m import name`` where ``m.name`` is no module
    records ``name`` as taken from ``m``."""
    is_package, tree = modules[module]
    package = module if is_package else module.rsplit(".", 1)[0]
    records = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    bound = alias.asname or alias.name.split(".")[0]
                    target = alias.name if alias.asname else alias.name.split(".")[0]
                    records.append((node.lineno, alias.name, None, None))
                    records.append((node.lineno, target, None, bound))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module
                                                                     else []))
            else:
                base = node.module
            if base not in modules:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    records.append((node.lineno, sub, None, alias.asname or alias.name))
                else:
                    records.append((node.lineno, base, alias.name, None))
    return records


def executed_files(target: str, importer: str):
    """The files importing ``target`` runs: the module and each package ``__init__`` on the way to
    it, except the packages that hold the importer (Python has begun those before the importer)."""
    parts = target.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [p for p in prefixes if p == target or not importer.startswith(p + ".")]


def import_graph(modules):
    """{module: set of the package's modules its imports run}, ``__init__`` files included."""
    graph = {}
    for module in modules:
        edges = set()
        for _, target, _, _ in import_records(modules, module):
            edges.update(executed_files(target, module))
        edges.discard(module)
        graph[module] = edges
    return graph


def import_circles(modules):
    """Each import circle across files: a strongly connected component of more than one module of
    the import graph (Tarjan), shown as one shortest circle through its first module and, when the
    component is larger than that circle, all of its members."""
    graph = import_graph(modules)
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    circles = []
    for component in sorted(components):
        start, inside = component[0], set(component)
        paths, seen, circle = [[start]], {start}, None
        while circle is None:  # breadth first: the shortest way from start back to start
            path = paths.pop(0)
            for nxt in sorted(graph[path[-1]] & inside):
                if nxt == start:
                    circle = path + [start]
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append(path + [nxt])
        text = " -> ".join(circle)
        if len(component) > len(circle) - 1:
            text += f"  (one circle of {component})"
        circles.append(text)
    return circles


def private_module_refused(name: str, importer: str) -> bool:
    """A private module ``p._m`` belongs to package ``p``: ``p/__init__.py`` and the modules
    inside ``p`` may import it, modules of other packages may not."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        owner = ".".join(parts[:i])
        if is_private(part) and importer != owner and not importer.startswith(owner + "."):
            return True
    return False


def private_uses(modules, module: str):
    """(module:line, name) for each private name ``module`` takes from another module of the
    package: ``from m import _x``, an import of a private module of another package, and ``m._x``
    (or ``getattr(m, "_x")``) on a name bound to a module of the package."""
    bad, bound = set(), {}
    for line, target, taken, name in import_records(modules, module):
        if taken is not None and is_private(taken):
            bad.add((f"{module}:{line}", f"{target}.{taken}"))
        elif private_module_refused(target, module):
            bad.add((f"{module}:{line}", target))
        if name is not None:
            bound[name] = target
    for node in ast.walk(modules[module][1]):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {
                "getattr", "setattr", "hasattr", "delattr"} and len(node.args) >= 2 and isinstance(
                node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            owner, attrs = node.args[0], [node.args[1].value]
        elif isinstance(node, ast.Attribute):
            owner, attrs = node.value, [node.attr]
        else:
            continue
        while isinstance(owner, ast.Attribute):
            attrs.insert(0, owner.attr)
            owner = owner.value
        if not isinstance(owner, ast.Name) or owner.id not in bound:
            continue
        current = bound[owner.id]
        for attr in attrs:
            name = f"{current}.{attr}"
            if name in modules:
                if private_module_refused(name, module):
                    bad.add((f"{module}:{node.lineno}", name))
                    break
                current = name
            else:
                if is_private(attr):
                    bad.add((f"{module}:{node.lineno}", name))
                break
    return sorted(bad)


@functools.lru_cache(maxsize=None)
def the_tree():
    return read_package(ROOT)


def test_no_import_circle_across_files():
    modules = the_tree()
    assert len(modules) > 60  # the walk found the package
    circles = import_circles(modules)
    assert circles == [], "import circles across files:\n" + "\n".join(circles)


def test_no_private_name_from_another_module():
    modules = the_tree()
    bad = [f"{where}: {name}" for module in modules for where, name in private_uses(modules,
                                                                                      module)]
    assert bad == [], "private names taken from another module:\n" + "\n".join(bad)


def write_package(root: pathlib.Path, files: dict):
    """A package ``pkg`` of ``files`` ({relative path: source}) under ``root``; its folder."""
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_negative_controls_for_circles(tmp_path):
    modules = read_package(write_package(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from . import a  # lazy: counts too\n",
        "c.py": "from .a import f\nimport pkg.b\n",  # imports the circle, is not in it
        "sub/__init__.py": "from .x import X\nY = 1\n",  # re-exports its child...
        "sub/x.py": "X = 1\n",
        "sub/y.py": "from . import Y\n",  # a child taking a name its __init__ defines: no circle
        "sub/x2.py": "from .. import d\n",  # x2 and d import each other: a circle
        "d.py": "from .sub.x2 import w\n",
        "e.py": "from .sub import Y\n",  # e runs sub/__init__.py, which imports no e: no circle
        "sub/w.py": "from ..e import nothing\n",
    }))
    circles = import_circles(modules)
    assert circles[0] == "pkg.a -> pkg.b -> pkg.a"
    assert not any("pkg.c" in circle for circle in circles)
    assert circles == ["pkg.a -> pkg.b -> pkg.a", "pkg.d -> pkg.sub.x2 -> pkg.d"]
    # an __init__ in a circle: a child takes a name its package's __init__ imports from the child
    modules = read_package(write_package(tmp_path / "two", {
        "__init__.py": "", "p/__init__.py": "from .m import M\n", "p/m.py": "from . import N\n"}))
    assert import_circles(modules) == ["pkg.p -> pkg.p.m -> pkg.p"]
    # importing p.q.m runs p/q/__init__.py first: a circle through another package's __init__
    modules = read_package(write_package(tmp_path / "three", {
        "__init__.py": "", "q/__init__.py": "from .m import M\n", "q/m.py": "M = 1\n",
        "r.py": "from .q.m import M\n", "q/n.py": "from ..r import M\n"}))
    assert import_circles(modules) == []
    modules = read_package(write_package(tmp_path / "four", {
        "__init__.py": "", "q/__init__.py": "from .n import N\n", "q/m.py": "M = 1\n",
        "r.py": "from .q.m import M\n", "q/n.py": "from ..r import M\n"}))
    assert import_circles(modules) == ["pkg.q -> pkg.q.n -> pkg.r -> pkg.q"]


def test_negative_controls_for_private_names(tmp_path):
    modules = read_package(write_package(tmp_path, {
        "__init__.py": "",
        "a.py": "_x = 1\ny = 2\n",
        "b.py": "from .a import _x, y, __doc__\n",
        "c.py": "from . import a\ndef f():\n    return a._x + a.y + getattr(a, '_x')\n",
        "d.py": "import pkg.a\nimport pkg.a as alias\nprint(pkg.a._x, alias._x, alias.__name__)\n",
        "ops/__init__.py": "from ._m import f\n",  # the package's own __init__: allowed
        "ops/_m.py": "def f(): pass\n",
        "ops/e.py": "from ._m import f\nfrom . import _m\n",  # inside its package: allowed
        "ops/deep/__init__.py": "",
        "ops/deep/g.py": "from .. import _m\n",  # inside ops, deeper: allowed
        "h.py": "from .ops._m import f\n",  # another package: refused
        "i.py": "from .ops import _m\nimport pkg.ops._m\nfrom . import ops\nops._m.f()\n",
    }))
    bad = {module: private_uses(modules, module) for module in modules}
    assert bad["pkg.b"] == [("pkg.b:1", "pkg.a._x")]
    assert bad["pkg.c"] == [("pkg.c:3", "pkg.a._x")]
    assert bad["pkg.d"] == [("pkg.d:3", "pkg.a._x")]
    assert bad["pkg.ops.e"] == bad["pkg.ops.deep.g"] == bad["pkg.ops"] == bad["pkg.a"] == []
    assert bad["pkg.h"] == [("pkg.h:1", "pkg.ops._m")]
    assert bad["pkg.i"] == [("pkg.i:1", "pkg.ops._m"), ("pkg.i:2", "pkg.ops._m"),
                            ("pkg.i:4", "pkg.ops._m")]
