"""The package's shape: layered subpackages, imports pointing down, no spec named outside the specs."""

from __future__ import annotations

import ast
from pathlib import Path

import symattn as sa

PACKAGE = Path(sa.__file__).resolve().parent
# Lower layers first: a module may import from its own layer and the ones before it.
LAYERS = (
    "errors",
    "lang",
    "autodiff",
    "optimize",
    "numeric",
    "specs",
    "derive",
    "codegen",
    "distributed",
    "trace",
    "cli",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "generated" not in p.parts}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The symattn modules a file imports, anywhere in it (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("symattn"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("symattn")}
    return {m for m in found if m in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in graph:
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state.get(child) == 1:
                path = [n for n, _ in stack]
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(child) :], child]))
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))


def test_imports_point_down_the_layers():
    upward = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if _layer(module) is not None and _layer(target) is not None and _layer(target) > _layer(module)
    ]
    assert not upward, upward


def test_every_subpackage_says_what_it_is_for():
    for init in PACKAGE.glob("*/__init__.py"):
        if init.parent.name in ("generated", "templates"):
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and doc.endswith("."), init


def test_code_generation_names_no_spec():
    # what a spec needs from code generation it declares itself (specs.Family); codegen asks, never names
    names = set(sa.specs())
    found = []
    for path in (PACKAGE / "codegen").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if text in names or ident in names:
                found.append(f"{path.name}:{node.lineno}: {text or ident}")
    assert not found, found


# A string equal to a function's name that means something else there: (module, name) → what it means.
OTHER_MEANINGS = {
    ("symattn/codegen/backends/printing.py", "exp"): "SymPy's scalar exp of a trainable scalar (numpy.exp → torch.exp)",
    ("symattn/codegen/backends/printing.py", "log"): "SymPy's scalar log of a trainable scalar",
    ("symattn/codegen/backends/printing.py", "tanh"): "SymPy's scalar tanh of a trainable scalar",
    ("symattn/derive/formats/layout.py", "exp"): r"the width of TeX's \exp",
    ("symattn/derive/formats/layout.py", "log"): r"the width of TeX's \log",
    ("symattn/derive/formats/layout.py", "tanh"): r"the width of TeX's \tanh",
    ("symattn/lang/ops_block.py", "tanh"): "gelu's approximate='tanh' option",
    ("symattn/trace/constants.py", "step"): "the constant program's reference to a recorded call's result",
    ("symattn/trace/forms/merged.py", "step"): "the constant program's reference to a recorded call's result",
    ("symattn/trace/forms/positions.py", "step"): "the constant program's reference to a recorded call's result",
    ("symattn/trace/forms/positions.py", "clamp"): "torch.clamp on tensors of positions, read as Min/Max",
    ("symattn/trace/forms/positions.py", "exp"): "torch.exp on tensors of positions, read as SymPy's exp",
    ("symattn/trace/forms/positions.py", "log"): "torch.log on tensors of positions (log buckets)",
    ("symattn/specs/block.py", "tanh"): "gelu's approximate='tanh' option",
    ("symattn/codegen/backends/torch/runtime.py", "tanh"): "torch's gelu(approximate='tanh')",
    ("symattn/codegen/backends/torch/dropin_block.py", "gelu"): "nn.TransformerEncoderLayer's activation='gelu'",
    ("symattn/codegen/backends/torch/dropin_block.py", "relu"): "nn.TransformerEncoderLayer's activation='relu'",
    ("symattn/codegen/backends/torch/dropin_block.py", "silu"): "the block family's activation='silu' (F.silu)",
    ("symattn/codegen/backends/torch/dropin_block.py", "tanh"): "torch's gelu(approximate='tanh')",
}


def test_a_function_is_named_only_by_its_record_and_its_export():
    """Every fact about an entrywise or row-wise function lives in its record (symattn.lang.functions,
    symattn.lang.rowwise); besides it, only the package's export may spell its name."""
    from symattn.lang.functions import FUNCTIONS

    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Constant)
                and node.value in FUNCTIONS
                and (module, node.value) not in OTHER_MEANINGS
            ):
                found.setdefault(node.value, set()).add(module)
    for name, modules in found.items():
        records = {"symattn/lang/functions.py", "symattn/lang/rowwise.py", "symattn/lang/piecewise.py"}
        others = modules - {"symattn/__init__.py", *records}
        assert len(modules) <= 2 and not others, (name, sorted(modules))


# A string equal to a backend's name that means something else there: (module, name) → what it means.
NOT_A_BACKEND = {
    ("symattn/codegen/backends/numpy/numba_kernels.py", "numpy"): "numba's error_model (no check of a zero divisor)",
    # a generated torch module's runtime (its source copied there): the route path() names to a user, no branch
    (
        "symattn/codegen/backends/torch/function_runtime.py",
        "triton",
    ): "path()'s answer: the call runs the Triton kernels",
    # the drop-ins (copied into the generated torch module) render their own backend's module, no branch
    ("symattn/codegen/backends/torch/dropin_runtime.py", "torch"): "the torch module of another configuration",
}


def test_a_backend_is_named_in_few_modules_and_branched_on_in_none():
    """The backends' names are written in at most three modules, and no module compares a backend name (or its
    constant) to choose what to do: code generation asks the Backend object (codegen/backends/)."""
    from symattn.codegen.backends import BACKENDS
    from symattn.lang.functions import TRITON

    names = set(BACKENDS) | {TRITON}
    constants = {"NUMPY", "TORCH", "JAX", "TRITON"}
    written, branches = set(), []
    for path in PACKAGE.rglob("*.py"):
        module = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names and (module, node.value) not in NOT_A_BACKEND:
                written.add(module)
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(
                    (isinstance(o, ast.Constant) and o.value in names)
                    or (isinstance(o, ast.Name) and o.id in constants)
                    for o in operands
                ):
                    branches.append(f"{module}:{node.lineno}")
    assert len(written) <= 3, sorted(written)
    assert not branches, branches
    templates = PACKAGE.parent / "templates"
    for template in templates.glob("*.j2"):
        assert not any(f'backend == "{n}"' in template.read_text(encoding="utf-8") for n in names), template


def test_the_printers_print_what_a_pass_decided():
    """The backends' printers make no decision about buffers or products: they read the statement's plan
    (``schedule.plan``) and hold no state about dying arrays, sizes or costs of their own."""
    decisions = {"chain_order", "typical_size", "tree_flops", "left_to_right_flops", "consumable", "pair_flops"}
    decisions |= {"widens", "narrows"}  # a product's 16-bit precision: the plan's ``precision``
    for path in (PACKAGE / "codegen" / "backends").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not names & decisions, (path.name, sorted(names & decisions))


def _sizes() -> tuple[dict[Path, int], dict[str, int], dict[str, int]]:
    """Modules per folder (``__init__`` aside), lines per module, lines per function (over the whole package)."""
    folders: dict[Path, int] = {}
    lines: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            folders[path.parent] = folders.get(path.parent, 0) + 1
        text = path.read_text(encoding="utf-8")
        module = str(path.relative_to(PACKAGE.parent))
        lines[module] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[f"{module}:{node.name}"] = node.end_lineno - node.lineno + 1
    return folders, lines, functions


def test_folders_modules_and_functions_stay_small():
    """No folder of more than 12 modules, no module over 450 lines, no function over 80."""
    folders, lines, functions = _sizes()
    assert not {str(k): v for k, v in folders.items() if v > 12}
    assert not {k: v for k, v in lines.items() if v > 450}
    assert not {k: v for k, v in functions.items() if v > 80}


def test_a_backend_is_one_folder():
    """Each backend's Backend object, printer and runtime live in codegen/backends/<name>/, beside the shared part
    (the Backend record, the printer mechanism, the common runtime); nothing else of code generation is a backend's."""
    from symattn.codegen.backends import BACKENDS, OPTIONAL_BACKENDS

    root = PACKAGE / "codegen" / "backends"
    for name, backend in (BACKENDS | OPTIONAL_BACKENDS).items():
        modules = {backend.printer.__module__, *backend.runtimes}
        own = {m for m in modules if m.startswith("symattn.codegen.backends.") and m.count(".") > 3}
        assert all(m.split(".")[3] == name for m in own), (name, sorted(own))
        assert (root / name / "__init__.py").is_file(), name
    folders = {p.parent.name for p in root.glob("*/__init__.py")}
    assert folders == set(BACKENDS | OPTIONAL_BACKENDS), sorted(folders)
    assert not (PACKAGE / "codegen" / "triton").exists()
