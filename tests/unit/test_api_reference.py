"""The API reference (docs/api) covers every module and every client method.

Sphinx builds the reference in ./check and fails on a reference to nothing;
what it cannot see is a module nobody listed or a method without a docstring
(autodoc leaves both out silently). These tests see them.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import harnessd
import protocol
from harnessd.api import ExecdClient

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "api"

# Modules the reference leaves out, each with its reason.
LEFT_OUT = {
    "harnessd.__main__": "the command line, rendered from its parser in cli.rst",
    "harnessd.cli_agent": "the command line, rendered from its parser in cli.rst",
    "harnessd.cli_bench": "the command line, rendered from its parser in cli.rst",
    "harnessd.cli_common": "the command line, rendered from its parser in cli.rst",
    "harnessd.cli_exec": "the command line, rendered from its parser in cli.rst",
    "harnessd.cli_mcp": "the command line, rendered from its parser in cli.rst",
    "harnessd.cli_gc": "the command line, rendered from its parser in cli.rst",
    "harnessd.cli_tty": "the command line, rendered from its parser in cli.rst",
    "harnessd.demo": "the demo command (docs/cli.md)",
    "protocol.fuzz.__main__": "the command line, rendered from its parser in cli.rst",
    "protocol.fuzz.cli": "the command line, rendered from its parser in cli.rst",
    "protocol.fuzz.coverage": "atheris's entry points, run as a program (docs/fuzzing.md)",
}


# What the optional integrations import.
OPTIONAL = {"ray", "verifiers", "mcp", "mcp_types", "uvicorn", "starlette", "anyio"}


def documented_modules() -> set[str]:
    names: set[str] = set()
    for page in REFERENCE.glob("*.rst"):
        names.update(re.findall(r"^\.\. automodule:: (\S+)$", page.read_text(), flags=re.M))
    return names


def package_modules() -> set[str]:
    names = {"harnessd", "protocol"}
    for package in (harnessd, protocol):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            names.add(info.name)
    return names


def test_every_module_is_in_the_reference_or_left_out_for_a_reason() -> None:
    documented = documented_modules()
    modules = package_modules()
    missing = sorted(modules - documented - LEFT_OUT.keys())
    assert not missing, f"add these modules to a page of docs/api: {missing}"
    gone = sorted((documented | LEFT_OUT.keys()) - modules)
    assert not gone, f"docs/api or LEFT_OUT names modules that do not exist: {gone}"


def test_every_public_member_of_the_client_has_a_docstring() -> None:
    """autodoc lists a method only when it has a docstring."""
    undocumented = [
        name
        for name, member in inspect.getmembers(ExecdClient)
        if not name.startswith("_") and not inspect.getdoc(member)
    ]
    assert not undocumented, f"ExecdClient members without a docstring: {undocumented}"


def test_every_public_function_and_class_has_a_docstring() -> None:
    undocumented = []
    for name in sorted(package_modules() - LEFT_OUT.keys()):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # harnessd.ray and harnessd.verifiers need their extras.
            if exc.name in OPTIONAL:
                continue
            raise
        for attr, value in vars(module).items():
            defined_here = getattr(value, "__module__", None) == name
            if attr.startswith("_") or not defined_here:
                continue
            if (inspect.isclass(value) or inspect.isfunction(value)) and not value.__doc__:
                undocumented.append(f"{name}.{attr}")
    assert not undocumented, f"public names without a docstring: {undocumented}"
