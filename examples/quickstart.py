import asyncio

import harnessd


async def main() -> None:
    # Start execd on this machine, connect, authenticate.
    async with harnessd.serve() as handle:
        client = handle.client
        result = await client.run(["sh", "-c", "echo hello; echo oops >&2; exit 3"])
        assert (result.exit_code, result.stdout, result.stderr) == (3, b"hello\n", b"oops\n")

        scratch = (await client.run(["mktemp", "-d"])).stdout.decode().strip()
        await client.write_file(f"{scratch}/notes/todo.txt", b"ship it\n", create_parents=True)
        assert await client.read_file(f"{scratch}/notes/todo.txt") == b"ship it\n"

        command = client.run_streaming(command="for i in 1 2 3; do echo $i; done")
        lines = [data async for _, data in command.output()]
        assert b"".join(lines) == b"1\n2\n3\n"
        assert (await command.result()).exit_code == 0

        try:
            await client.read_file(f"{scratch}/missing.txt")
        except harnessd.NotFound as exc:
            print(f"typed error, wire code {exc.code}: {exc.message}")
        await client.remove(scratch, recursive=True)
    # Leaving the block closed execd: every process it started is gone.
    print("quickstart: ok")


asyncio.run(main())
