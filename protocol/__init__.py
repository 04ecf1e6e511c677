"""Sans-I/O wire protocol shared by execd and harnessd.

Nothing in this package performs I/O or imports asyncio, anyio or socket,
except :mod:`protocol.bridge`, the one module that glues the state machines to
asyncio transports.
"""
