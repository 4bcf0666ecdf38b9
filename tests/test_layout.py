"""The package layout as drawn: who may import whom, no import circles, a stable public API.

The imports are read from the source (every ``import`` statement, including
those inside functions), so a rule broken by a lazy import is caught too.
"""

import ast
import importlib
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import tfmath

PACKAGE = Path(tfmath.__file__).parent
ROOT = PACKAGE.parent

#: Bottom to top: a module may import modules of its own layer or of layers below.
LAYERS = (
    (
        "infrastructure",
        (
            "tfmath.errors",
            "tfmath._version",
            "tfmath._cuda",
            "tfmath._jit",
            "tfmath._kernel_cache",
            "tfmath._blas_threads",
            "tfmath._cuda_switches",
            "tfmath._blas_kernel",
        ),
    ),
    ("contract", ("tfmath._contract", "tfmath._dispatch")),
    ("implementations", ("tfmath.kernels", "tfmath.reference")),
    (
        "topics",
        (
            "tfmath.attention",
            "tfmath.positional",
            "tfmath.variance",
            "tfmath.efficient",
            "tfmath.rnn",
            "tfmath.variants",
            "tfmath.formulas",
        ),
    ),
    # The PyTorch drop-ins sit with the training stack, whose layer functions some wrap.
    ("training", ("tfmath.training", "tfmath.nn")),
    ("analysis", ("tfmath.analysis",)),
    ("plotting", ("tfmath.plotting",)),
    ("tools", ("tfmath.tools", "tfmath.report", "tfmath.experiments", "tfmath.view", "tfmath.cli")),
    ("package", ("tfmath.__main__", "tfmath")),
)

#: What kernels and oracles may import besides their own package.
IMPLEMENTATION_DEPENDENCIES = (
    "tfmath._contract",
    "tfmath.kernels.formulas",
    "tfmath._jit",
    "tfmath._blas_threads",
    "tfmath._cuda_switches",
    "tfmath._cuda",
    "tfmath.errors",
)


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _existing_module(name):
    """The longest prefix of a dotted name that is a tfmath module."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(name):
    """The tfmath modules that module ``name`` imports, anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfmath"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else _existing_module(node.module))
        elif isinstance(node, ast.Import):
            found.update(
                _existing_module(a.name) for a in node.names if a.name.startswith("tfmath")
            )
    found.discard(name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name):
    matches = [
        (len(prefix), rank)
        for rank, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".")
    ]
    assert matches, f"{name} belongs to no layer of the drawing; add it to LAYERS"
    return max(matches)[1]


def _within(name, prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_every_module_sits_in_a_layer():
    for name in MODULES:
        _layer(name)


def test_nothing_imports_upward():
    upward = [
        f"{name} ({LAYERS[_layer(name)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})"
        for name, deps in GRAPH.items()
        for dep in deps
        if dep != "tfmath" and _layer(dep) > _layer(name)
    ]
    assert upward == []


@pytest.mark.parametrize(
    "package", ["tfmath.kernels.cpu", "tfmath.kernels.cuda", "tfmath.reference"]
)
def test_kernels_and_oracles_import_only_the_contract_and_their_own_package(package):
    allowed = (*IMPLEMENTATION_DEPENDENCIES, package)
    broken = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if _within(name, (package,))
        for dep in deps
        if not _within(dep, allowed)
    ]
    assert broken == []


def test_only_the_dispatch_layer_opens_the_kernels_and_the_oracles():
    """Above the kernels and the NumPy oracles, code reaches them through
    tfmath._dispatch (``run``, ``implementation`` or ``direct``), which imports them by
    name, never by statement; what the oracles share with the analysis (a feature map's
    definition, the exact angle reduction) lives in the contract."""
    bottom = ("tfmath.kernels", "tfmath.reference")
    doors = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if not _within(name, bottom)
        for dep in deps
        if _within(dep, bottom)
    ]
    assert doors == []


@pytest.mark.parametrize("name", ["plain_plan", "training_step", "gemm"])
def test_every_direct_door_opens(name):
    from tfmath import _dispatch

    assert _dispatch.DIRECT[name].partition(":")[0] in MODULES
    assert _dispatch.direct(name) is not None


def test_the_contract_imports_only_infrastructure():
    broken = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if _within(name, ("tfmath._contract",))
        for dep in deps
        if not _within(dep, ("tfmath._contract", "tfmath._cuda", "tfmath.errors"))
    ]
    assert broken == []


def test_only_cuda_module_imports_numba_cuda():
    importers = sorted(
        name
        for name, path in MODULES.items()
        if re.search(
            r"^\s*(from numba import cuda|import numba\.cuda|from numba\.cuda)",
            path.read_text(),
            re.M,
        )
    )
    assert importers == ["tfmath._cuda"]


def test_there_is_no_import_circle():
    circles = []
    state = {}

    def visit(name, path):
        state[name] = "open"
        for dep in sorted(GRAPH[name] - {"tfmath"}):
            if state.get(dep) == "open":
                circles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[name] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert circles == []


# -- the public API stays importable -------------------------------------------------------


def test_every_name_in_all_is_importable():
    missing = [name for name in tfmath.__all__ if not hasattr(tfmath, name)]
    assert missing == []


def _resolve(dotted):
    """Import the longest importable module prefix of ``dotted``, then get the rest."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


def _documented_paths():
    texts = [p.read_text() for p in (ROOT / "docs").glob("*.rst")]
    texts.append((ROOT / "README.md").read_text())
    paths = set()
    for text in texts:
        paths.update(re.findall(r"\btfmath(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text))
        # autosummary entries are relative to ``.. currentmodule:: tfmath``
        for block in re.findall(r"\.\. autosummary::\n((?:   .*\n|\n)+)", text):
            paths.update(
                f"tfmath.{entry.strip()}"
                for entry in block.splitlines()
                if entry.strip() and not entry.strip().startswith(":")
            )
    return sorted(paths)


@pytest.mark.parametrize("dotted", _documented_paths())
def test_every_dotted_path_in_the_docs_is_importable(dotted):
    _resolve(dotted)


# -- a call, followed from its public function to its kernel ------------------------------


#: The layers a call crosses on its way down, by module prefix.
_CALL_LAYERS = {"_contract": "validation", "_dispatch": "dispatch", "kernels": "kernel"}


def _layers_entered(call, public_module):
    """The layers that ``public_module``'s own code calls into until the first kernel
    runs, each run of calls into one layer counted once."""
    entered = []

    def trace(frame, event, arg):
        if event != "call" or (entered and entered[-1] == "kernel"):
            return None
        module = frame.f_globals.get("__name__") or ""
        caller = frame.f_back.f_globals.get("__name__") if frame.f_back else ""
        layer = next((v for k, v in _CALL_LAYERS.items() if module.startswith(f"tfmath.{k}")), None)
        if layer == "kernel" or (layer and caller == public_module):
            if not entered or entered[-1] != layer:
                entered.append(layer)
        return None

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return entered


_q, _k, _v = (np.random.default_rng(seed).standard_normal((2, 3, 16, 8)) for seed in range(3))
_CALLS = {
    "plain attention": (
        lambda: tfmath.scaled_dot_product_attention(_q, _k, _v),
        "tfmath.attention",
    ),
    "masked attention": (
        lambda: tfmath.scaled_dot_product_attention(_q, _k, _v, attn_mask=np.zeros((16, 16))),
        "tfmath.attention",
    ),
    "attention_grad": (lambda: tfmath.attention_grad(_q, _k, _v, _q), "tfmath.attention"),
    "softmax": (lambda: tfmath.softmax(_q), "tfmath.attention"),
    "flash_attention with a window": (
        lambda: tfmath.flash_attention(_q, _k, _v, causal=True, window_size=(4, 0)),
        "tfmath.variants",
    ),
    "linear attention": (lambda: tfmath.linear_attention(_q, _k, _v), "tfmath.efficient"),
    "layer_norm": (
        lambda: tfmath.training.layers.layer_norm(_q[0, 0], np.ones(8), np.zeros(8)),
        "tfmath.training.layers.norms",
    ),
    "sinusoidal": (lambda: tfmath.sinusoidal_encoding(16, 8), "tfmath.positional"),
}


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_a_call_reaches_its_kernel_through_each_layer_once(name):
    call, module = _CALLS[name]
    call()  # compiled and imported first
    assert _layers_entered(call, module) == ["validation", "dispatch", "kernel"]
