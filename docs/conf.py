"""Sphinx configuration for the tfmath documentation.

Build from the repository root, with warnings as errors::

    sphinx-build -W --keep-going -b html docs docs/_build/html

The build needs no network: intersphinx is deliberately not used, and MathJax
is copied into the built pages (``_static/mathjax``, from the
``sphinx-mathjax-offline`` package), so the math renders offline too.

The gallery (``examples/*.py`` at the repository root) is executed at every
build by sphinx-gallery; its pages, like autosummary's, are generated into
git-ignored folders (``docs/gallery/``, ``docs/api/generated/``).
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
    # MathJax's files, copied into the build (no CDN).
    "sphinx-mathjax-offline",
    "sphinx_gallery.gen_gallery",
]

templates_path = ["_templates"]
# docs/_ext: the gallery's figure scraper.
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))
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

# -- the gallery -------------------------------------------------------------

# tfmath's plotting helpers draw on pyplot-free Figures, so the gallery collects
# the Figures each example made (see _ext/gallery_figures.py) rather than
# pyplot's. An example's last expression with an HTML view (the attention view)
# is embedded in its page.
sphinx_gallery_conf = {
    "examples_dirs": ["../examples"],
    "gallery_dirs": ["gallery"],
    "filename_pattern": r"/plot_",
    "image_scrapers": ("gallery_figures.scrape_figures",),
    "capture_repr": ("_repr_html_",),
    "download_all_examples": False,
    "remove_config_comments": True,
    "within_subsection_order": "FileNameSortKey",
    # An example that raises fails the build.
    "abort_on_example_error": True,
    "write_computation_times": False,
    "show_memory": False,
}

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


def setup(app):
    # The sidebar's page titles hold formulas, so every page needs MathJax, not
    # only those whose body has math (Sphinx's default).
    app.set_html_assets_policy("always")
