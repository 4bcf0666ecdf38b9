"""The Examples sections of tfmath's docstrings run and print what they show.

Every module of the package is imported and its docstrings' examples are run by
:mod:`doctest`, as a reader would paste them; a failure names the module and the
example. (Two had drifted from the code: an example importing the wrong name, and
one printing NumPy 2's ``np.True_`` where it showed ``True``.)
"""

import doctest
import importlib
import pkgutil

import pytest

import tfmath

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(tfmath.__path__, "tfmath.")
    if not name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_in_the_docstrings_run(name):
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def test_no_docstring_holds_a_control_character():
    """A backslash in a docstring that is not raw can become a control character:
    ``:math:`3\\times``` in a plain docstring is a tab and "imes" (FlopsPerToken's
    was, as was a bell from ``\\alpha``). Docstrings read from the source, every one."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted(Path(tfmath.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False) or ""
                if any(character in doc for character in "\t\a\b\f\v\r"):
                    found.append(f"{path.name}: {getattr(node, 'name', 'module')}")
    assert not found, found
