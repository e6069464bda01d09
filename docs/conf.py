"""Sphinx configuration: `make docs` builds docs/_build/html with warnings as errors.

The Markdown pages (the README, included by index.md, and the guides beside this file) are read
by myst-parser; the API reference (api.md) is autodoc over the docstrings, read by napoleon
(Google style). Nothing here needs the network: no intersphinx, so names from JAX, optax and
NumPy in signatures are left unlinked (``nitpick_ignore_regex`` below).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import sys
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the source tree's jaxkv, installed or not

import jaxkv  # noqa: E402

project = "jaxkv"
author = "the jaxkv authors"
copyright = "the jaxkv authors"
release = version = jaxkv.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown: `#`-headings get anchors (design.md#many-processes), ```{directive} blocks work.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# Google-style docstrings (STYLE.md item 6); their ``>>>`` examples are pytest's doctests.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True  # `values=MISSING`, not `<object object at 0x...>`
autodoc_default_options = {"members": True}

html_theme = "alabaster"
html_title = f"jaxkv {release}"
html_theme_options = {"description": "MXNet's KVStore, rebuilt on JAX", "fixed_sidebar": False}

# Every reference must resolve (-n), except to names of other libraries: without intersphinx
# (it fetches inventories over the network) JAX's, optax's, NumPy's and the standard library's
# names in signatures have no target here.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|chex|numpy|np|npt|jnp)(\..*)?"),
    (r"py:.*", r"(collections\.abc|typing|types|os|pathlib|builtins)\..*"),
    # The same names imported bare (``from jax.sharding import NamedSharding``).
    (r"py:.*", r"(Mesh|NamedSharding|PartitionSpec|ArrayLike|DTypeLike)"),
    # jaxkv's private alias for a key, ``int | str`` (each function's doc says which keys).
    (r"py:.*", r"Key"),
    # The MXNet optimizers' kernels' private alias for their scalars (name -> float32 scalar).
    (r"py:.*", r"Scalars"),
    # The private layout bookkeeping in KVState's constructor (made by jaxkv.empty, not users).
    (r"py:.*", r"(Policy|FlatLayout|Packing)"),
    # The store's private static facts, a cached computation's key (KVState.facts).
    (r"py:.*", r"Facts(\..*)?"),
    # An MXNet optimizer's private mark of its bookkeeping (Optimizer.bookkeeping).
    (r"py:.*", r"_Mark"),
]


class LaunchHelp(SphinxDirective):
    """``{launch-help}``: the output of ``python -m jaxkv.launch --help``, taken from the parser
    when the docs are built, so the page cannot drift from the options."""

    def run(self):
        from jaxkv import launch

        out = io.StringIO()
        old = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100"
        try:
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                launch.main(["--help"])
        finally:
            if old is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = old
        text = out.getvalue()
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


# The README's links into the repository outside docs/ (``docs/...`` links are handled by the
# include's ``relative-docs`` option in index.md): on GitHub they open the file; in the built
# site they point at a page that includes it, or download it. A new link of this kind fails the
# build (myst's xref_missing warning) until it is added here.
README_LINKS = {
    "conformance/README.md": "conformance.md",
    "notebooks/kvstore_tutorial.ipynb": "path:../notebooks/kvstore_tutorial.ipynb",
}


def _readme_links(app, relative_path, parent_docname, content):
    """``include-read``: rewrite :data:`README_LINKS` in the README that index.md includes."""
    if Path(relative_path).name != "README.md" or parent_docname != "index":
        return
    for target, replacement in README_LINKS.items():
        content[0] = content[0].replace(f"]({target})", f"]({replacement})")


class _Raw(str):
    """An annotation shown as written (``inspect`` would quote a string)."""

    def __repr__(self) -> str:
        return str(self)


def _source_signature(app, what, name, obj, options, signature, return_annotation):
    """``autodoc-process-signature``: annotations as the source writes them (``npt.DTypeLike``,
    ``jax.Array``), not evaluated and expanded (NumPy's aliases become long private unions)."""
    if signature is None or what not in ("function", "method", "class", "exception"):
        return None
    if getattr(obj, "_is_protocol", False):  # a Protocol (Updater) is not instantiated
        return "", None
    try:
        sig = inspect.signature(obj, eval_str=False)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if what == "method" and params and params[0].name in ("self", "cls"):
        params = params[1:]
    params = [
        q.replace(annotation=_Raw(q.annotation)) if isinstance(q.annotation, str) else q
        for q in params
    ]
    ret = sig.return_annotation
    shown = sig.replace(parameters=params, return_annotation=inspect.Signature.empty)
    if what in ("class", "exception") or ret is inspect.Signature.empty:
        return str(shown), None
    return str(shown), str(ret)


def setup(app):
    app.connect("autodoc-process-signature", _source_signature)
    app.add_directive("launch-help", LaunchHelp)
    app.connect("include-read", _readme_links)
