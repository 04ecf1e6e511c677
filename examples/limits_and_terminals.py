import asyncio
import sys

import harnessd


async def main() -> None:
    async with harnessd.serve() as handle:
        client = handle.client
        # How this execd enforces each limit (cgroup-v2, cgroup-v1 or rlimit).
        print((await client.server_info()).limits)

        # A runaway command ends at its limit; the result says which one.
        result = await client.run(
            ["sh", "-c", "while :; do :; done"],
            limits={"memory": 256 << 20, "cpu": 1.0, "file_size": 64 << 20, "open_files": 256},
        )
        assert result.limit_exceeded == "cpu"
        print(f"stopped by its {result.limit_exceeded} limit (signal {result.signal})")

        # A program that wants a terminal: a Python REPL driven by keystrokes.
        async with await client.open_terminal([sys.executable, "-i", "-q"]) as term:
            await term.read(timeout=30, until=b">>> ")
            await term.send(b"6 * 7\n")
            # The answer, then the next prompt: the REPL reads again (keys typed earlier may be dropped).
            assert b"42" in await term.read(timeout=30, until=b"42\r\n>>> ")
            await term.send(b"\x04")  # Ctrl-D: end of input, the REPL exits
            assert (await term.wait(timeout=30)).exit_code == 0
    print("limits and terminals: ok")


asyncio.run(main())
