"""``harnessd`` whose ``exec`` client is slow to start reading a command's output.

``python -m tests.support.slow_exec exec ARGS`` runs ``harnessd exec ARGS``
with a pause of ``SLOW_EXEC_DELAY`` seconds (default 0.2) between starting
the command and reading its output: long enough for a short command to have
ended, and execd's answer to have arrived, before the first read.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from harnessd import cli_exec
from harnessd.__main__ import main
from harnessd.api import RunningCommand
from protocol.rpc.shell import RunResult

_read_output = cli_exec._stream


async def _read_output_late(command: RunningCommand[RunResult], *args: Any, **kwargs: Any) -> int:
    await asyncio.sleep(float(os.environ.get("SLOW_EXEC_DELAY", "0.2")))
    return await _read_output(command, *args, **kwargs)


cli_exec._stream = _read_output_late

if __name__ == "__main__":
    sys.exit(main())
