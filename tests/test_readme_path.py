"""A reader's first minutes: the README's Quick start, in a fresh virtualenv, in order.

The commands are read from the README itself, so this test follows the README
when it changes. It needs pip to reach a package index (as ``.ci/run`` does)
and takes a few minutes: deselect it with ``-m "not slow"``.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: What a working checkout holds that a fresh clone would not: at its top level,
#: and anywhere below it.
_NOT_IN_A_CLONE_AT_TOP = {
    ".git",
    ".venv",
    ".ci-venv",
    ".asv",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
    "build",
    "dist",
    "report",
}
_NOT_IN_A_CLONE_ANYWHERE = ("__pycache__", "*.egg-info", "*.nbi", "*.nbc", "_build")


def _copy_as_a_clone(destination):
    ignore_anywhere = shutil.ignore_patterns(*_NOT_IN_A_CLONE_ANYWHERE)

    def ignore(folder, names):
        ignored = ignore_anywhere(folder, names)
        if Path(folder) == ROOT:
            ignored |= _NOT_IN_A_CLONE_AT_TOP.intersection(names)
        return ignored

    shutil.copytree(ROOT, destination, ignore=ignore)


def section_commands(readme_text, heading):
    """The shell commands in the code blocks of one README section, in order."""
    section = re.search(rf"^## {heading}\n(.*?)(?=^## |\Z)", readme_text, re.S | re.M)
    if section is None:
        raise AssertionError(f"README.md has no '## {heading}' section")
    blocks = re.findall(r"^```(?:bash|sh|console)\n(.*?)^```", section.group(1), re.S | re.M)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_quick_start_has_exactly_two_commands():
    commands = section_commands(README.read_text(), "Quick start")
    assert len(commands) == 2, commands
    install_and_run, install_and_test = commands
    assert "tfmath reproduce" in install_and_run
    assert "pytest" in install_and_test


def _fresh_environment(tmp_path, venv):
    """A reader's environment: the new venv first on PATH, nothing of this test run's."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TFMATH_", "NUMBA_", "PYTHON", "PYTEST_", "VIRTUAL_ENV"))
    }
    # The reader's own caches start empty; pip keeps its cache so installs stay quick.
    pip_cache = subprocess.run(
        [sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True
    ).stdout.strip()
    if pip_cache:
        env["PIP_CACHE_DIR"] = pip_cache
    env["XDG_CACHE_HOME"] = str(tmp_path / "user-cache")
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    # The README's test command runs the suite this test belongs to; inside
    # it, one module is enough to show that the editable install imports.
    env["PYTEST_ADDOPTS"] = "-q -p no:cacheprovider tests/test_validation.py"
    return env


def _run(command, *, cwd, env):
    completed = subprocess.run(
        command, shell=isinstance(command, str), cwd=cwd, env=env, capture_output=True, text=True
    )
    assert completed.returncode == 0, (
        f"{command!r} in {cwd} exited {completed.returncode}\n"
        f"--- stdout ---\n{completed.stdout[-4000:]}\n--- stderr ---\n{completed.stderr[-4000:]}"
    )
    return completed.stdout


def _site_packages(python, env):
    return Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            cwd="/",
            env=env,
        ).strip()
    )


@pytest.mark.slow
def test_quick_start_in_order_leaves_a_working_install(tmp_path):
    clone = tmp_path / "clone"
    _copy_as_a_clone(clone)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = _fresh_environment(tmp_path, venv)
    python = str(venv / "bin" / "python")

    readme = README.read_text()
    for command in section_commands(readme, "Quick start"):
        _run(command, cwd=clone, env=env)
    assert (clone / "report" / "index.html").stat().st_size > 0

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    info = _run("tfmath info", cwd=elsewhere, env=env)
    assert "kernel cache:" in info
    imported_from = _run(
        [
            python,
            "-c",
            "import tfmath; tfmath.scaled_dot_product_attention; print(tfmath.__file__)",
        ],
        cwd=elsewhere,
        env=env,
    )
    assert Path(imported_from.strip()) == clone / "tfmath" / "__init__.py"

    # Nothing of tfmath's is left in site-packages, and its kernels were cached
    # under the user's cache folder, not beside the installed sources.
    leftovers = sorted(_site_packages(python, env).glob("tfmath/**/*"))
    assert leftovers == [], leftovers[:10]
    assert any((tmp_path / "user-cache" / "tfmath").rglob("*.nbi"))

    # The README's Benchmarks section: install asv, then discover the suite.
    install_bench = section_commands(readme, "Benchmarks")[0]
    assert install_bench.startswith("python -m pip install"), install_bench
    _run(install_bench, cwd=clone, env=env)
    _run("asv check -E existing", cwd=clone, env=env)
