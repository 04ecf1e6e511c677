"""A session whose network drops in the middle of a command: nothing is lost.

The session reaches execd through a small relay that this program cuts while
a command is printing, and keeps refusing connections for a moment (an
outage). The session dials execd again by itself until it gets through; the
command, still running in execd, is reattached, and every line it printed
arrives, once. A call made while the connection is down waits for the new
one and runs there.
"""

import asyncio

import harnessd


class Relay:
    """Forwards a local port to execd; cut() drops every connection, as a vanished route does."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.links: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None
        self.refusing = False

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        self.links |= {writer, up_writer}
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self.links:
            writer.transport.abort()
        self.links.clear()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(64 * 1024):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.transport.abort()


async def main() -> None:
    async with harnessd.serve() as session:
        direct = session.port
        relay = Relay(direct)
        session.host, session.port = "127.0.0.1", await relay.start()
        await session.reconnect()  # from now on through the relay
        first = session.client

        command = first.run_streaming(command="for i in $(seq 1 20); do echo $i; sleep 0.1; done")
        received = bytearray()
        halfway = asyncio.Event()

        async def read() -> None:
            async for _, data in command.output():
                received.extend(data)
                if received.count(b"\n") >= 5:
                    halfway.set()

        reading = asyncio.ensure_future(read())
        await halfway.wait()
        relay.refusing = True  # an outage begins
        relay.cut()
        lines = received.count(b"\n")
        print(f"cut after {lines} lines")
        while not first.closed:  # the client sees the reset
            await asyncio.sleep(0.01)

        # Made on the lost connection: it waits for the new one, then runs there.
        echo = asyncio.ensure_future(first.echo(b"made while down"))
        await asyncio.sleep(0.5)
        assert not echo.done()
        relay.refusing = False  # the outage ends
        assert await echo == b"made while down"
        await reading
        result = await command.result()
        assert received == b"".join(b"%d\n" % i for i in range(1, 21)), received
        assert session.client is not first
        print(f"all 20 lines, exit code {result.exit_code}, on a new connection")

        # Back to a direct connection, so that closing does not need the relay.
        session.port = direct
        await session.reconnect()
        await relay.close()
    print("reconnect: ok")


asyncio.run(main())
