"""Sphinx configuration of the API reference.

``./check`` builds it with warnings as errors (``-W``) and every cross-reference
checked (``nitpicky``): a docstring naming an object that does not exist, or a
module that fails to import, fails the check. Build it yourself with::

    pip install -e '.[docs]'
    python -m sphinx -b html -n -W docs/api build/api-reference
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

project = "splitexec"
extensions = ["sphinx.ext.autodoc", "sphinxarg.ext"]
nitpicky = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Aliases a signature shows by name, resolved to where they are declared.
autodoc_type_aliases = {"LimitName": "protocol.rpc.resources.LimitName"}
# The MCP SDK's models (pydantic) do not build under autodoc's importer; harnessd.mcp
# is documented against stand-ins for it.
autodoc_mock_imports = ["mcp", "mcp_types", "anyio", "uvicorn", "starlette"]
html_theme = "alabaster"
html_static_path: list[str] = []

# Only references to our own packages are checked: the standard library's and other
# packages' inventories would have to be downloaded, which this build does not do.
nitpick_ignore_regex = [
    # Another package's names (collections.abc.Callable, msgspec.Meta, ray.ObjectRef, ...).
    (r"py:.*", r"(?!(harnessd|protocol|execd)\.)_?[a-z]\w*\..*"),
    # What a type annotation's metadata shows as a name: numbers, a cut subscript.
    (r"py:.*", r"[\d.]+|\w+\[[\w\[]+"),
    # Type variables (harnessd.client.R).
    (r"py:.*", r"(harnessd|protocol)\.[\w.]*\.[A-Z]"),
    # Private names (bases such as _ProcessRuntime) are not in the reference.
    (r"py:.*", r"(.*\.)?_[A-Za-z]\w*"),
]
