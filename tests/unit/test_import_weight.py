"""The model client's HTTP stack loads only when a model request is made.

execd runs in the workspace and never needs it; ``import harnessd`` (the
client library) and ``harnessd.models`` / ``harnessd.agent`` (a scripted
session, the demo) should not pay for it either.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("httpx", "httpcore", "h11", "certifi", "idna")


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
    code = f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(done.stdout.split())
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


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
