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
