"""Sphinx configuration for the tfmath documentation.

Build from the repository root, with warnings as errors::

    sphinx-build -W --keep-going -b html docs docs/_build/html

The build needs no network: intersphinx is deliberately not used. MathJax is
loaded by the reader's browser, not at build time.
"""

import sys
from pathlib import Path

# tfmath is normally installed (editable) in the environment that builds the
# docs; putting the checkout first makes the build document this tree.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tfmath

# -- Project information -----------------------------------------------------

project = "tfmath"
author = "the tfmath developers"
copyright = "the tfmath developers"
release = tfmath.__version__
version = ".".join(release.split(".")[:2])

# -- General configuration ---------------------------------------------------

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
]

templates_path = ["_templates"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
root_doc = "index"
language = "en"

# -- autodoc / autosummary ---------------------------------------------------

# Stub pages for everything listed in api.rst, written to docs/api/generated/
# (git-ignored) on every build.
autosummary_generate = True
autosummary_generate_overwrite = True
autodoc_typehints = "none"
autodoc_member_order = "bysource"

# -- numpydoc ----------------------------------------------------------------

numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = True

# -- HTML output -------------------------------------------------------------

html_theme = "alabaster"
html_title = f"tfmath {release}"
html_theme_options = {
    "description": "A Numba-accelerated toolkit for the mathematics of transformers",
    "fixed_sidebar": True,
    "show_relbars": True,
}
html_sidebars = {
    "**": ["about.html", "navigation.html", "relations.html", "searchbox.html"],
}
