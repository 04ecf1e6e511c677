"""What stays unimported until it is needed.

The model client's HTTP stack loads only when a model request is made: execd
runs in the workspace and never needs it; ``import harnessd`` (the client
library) and ``harnessd.models`` / ``harnessd.agent`` (a scripted session, the
demo) should not pay for it either. execd listens without the modules it
defers to their first use (its cold start pays for every import before it
listens).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HEAVY = ("httpx", "httpcore", "h11", "certifi", "idna")


def _modules_after(code: str) -> set[str]:
    """The words ``code``, run by a fresh interpreter, prints (the modules it lists)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return set(done.stdout.split())


@pytest.mark.parametrize(
    "statement",
    [
        "import execd.__main__, execd.app, execd.server",
        "import harnessd",
        "import harnessd.agent, harnessd.models, harnessd.openai_model, harnessd.tools, harnessd.demo",
        "import harnessd.__main__",
    ],
)
def test_the_http_stack_is_not_imported(statement: str) -> None:
    loaded = _modules_after(f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))")
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


FUZZING = ("hypothesis", "atheris")


@pytest.mark.parametrize(
    "statement",
    [
        "import protocol, protocol.connection, protocol.bridge",
        "import protocol.fuzz, protocol.fuzz.cli",
        "import harnessd",
        "import harnessd.__main__",
    ],
)
def test_the_fuzzing_extras_are_not_imported(statement: str) -> None:
    """hypothesis and atheris (the fuzz and atheris extras) load only when the kit fuzzes."""
    loaded = _modules_after(f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))")
    roots = {name.split(".")[0] for name in loaded}
    assert not roots & set(FUZZING), sorted(roots & set(FUZZING))


MCP_STACK = ("mcp", "mcp_types", "pydantic", "starlette", "uvicorn", "httpx2", "anyio")
"""What the MCP server (the ``mcp`` extra) brings; only ``harnessd mcp`` may load it."""


@pytest.mark.parametrize("statement", ["import harnessd", "import harnessd.__main__"])
def test_the_mcp_sdk_is_not_imported(statement: str) -> None:
    loaded = _modules_after(f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))")
    early = sorted(name for name in loaded if name.split(".")[0] in MCP_STACK)
    assert early == [], early


def test_the_first_request_imports_it() -> None:
    code = (
        "import asyncio, sys\n"
        "from harnessd.models import ModelTransportError\n"
        "from harnessd.openai_model import OpenAIChatModel\n"
        "m = OpenAIChatModel('m', 'http://127.0.0.1:9/v1', None, max_retries=0, timeout=5)\n"
        "try:\n"
        "    asyncio.run(m.complete([], []))\n"
        "except ModelTransportError:\n"
        "    pass\n"
        "print('httpx' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "True"


STARTUP_DEFERRED = (
    "cryptography",  # the AEAD bindings: on the first encrypted connection
    "execd.shell",  # every capability: on the first call of one of its methods
    "execd.files",
    "execd.spawn",
    "execd.limits",  # resource limits and cgroups: with the first command capability
    "execd.cgroups",
    "protocol.rpc.shell",
    "tempfile",  # only for a fallback state directory or a private root
    "shutil",  # argparse asks it for the terminal width only to print help
    "random",  # random bytes come from os.urandom, not the secrets module
    "encodings.idna",  # an address to bind needs no resolving (uvloop's resolver encodes names)
)


def test_execd_listens_without_what_it_defers(tmp_path: pathlib.Path) -> None:
    """Parsing the command line, building execd and binding its socket leave these unimported."""
    code = (
        "import asyncio, sys, uvloop\n"
        "from execd.__main__ import _config, _parser\n"
        "from execd.app import Execd\n"
        "async def main():\n"
        f"    argv = ['--state-dir', {str(tmp_path)!r}, '--marker', 'm' * 32, '--lease', '60']\n"
        "    app = Execd(_config(_parser().parse_args(argv)), b't' * 32)\n"
        "    await app.server.start()\n"
        "    print(' '.join(sorted(sys.modules)))\n"
        "    await app.server.close()\n"
        "uvloop.run(main())  # as execd runs\n"
    )
    loaded = _modules_after(code)
    assert "execd.server" in loaded
    early = sorted(
        name
        for name in loaded
        for deferred in STARTUP_DEFERRED
        if name == deferred or name.startswith(deferred + ".")
    )
    assert early == [], early


def test_execd_serves_with_the_collector_on_and_startup_frozen(tmp_path: pathlib.Path) -> None:
    """``python -m execd`` imports with the collector off; it is on again before serving."""
    code = (
        "import gc, runpy, sys\n"
        "import execd.app\n"
        "async def serve(self):\n"
        "    print(gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "    return 0\n"
        "execd.app.Execd.run = serve\n"
        f"sys.argv = ['execd', '--state-dir', {str(tmp_path)!r}]\n"
        "runpy.run_module('execd', run_name='__main__', alter_sys=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "EXECD_TOKEN": "t" * 32},
    )
    assert done.stdout.splitlines()[0] == "True True", (done.stdout, done.stderr)
