"""Every RPC of execd, declared once: its name, its params and its result.

One module per capability (:mod:`~protocol.rpc.core`, :mod:`~protocol.rpc.files`,
:mod:`~protocol.rpc.shell`, :mod:`~protocol.rpc.services`,
:mod:`~protocol.rpc.sessions`, :mod:`~protocol.rpc.watch`,
:mod:`~protocol.rpc.ledger`, :mod:`~protocol.rpc.terminal`, :mod:`~protocol.rpc.request`; limits in
:mod:`~protocol.rpc.resources`) holds the Structs of its methods and, at its end,
one :class:`Rpc` per method. Both ends use those declarations and nothing
else: execd binds each to the handler named after it
(``execd.context.bind``; a test holds the handler's annotations to the
declaration) and the client calls through them
(``await client.call(files.STAT, files.StatParams(path=p))`` is typed
:class:`~protocol.rpc.files.StatResult`). PROTOCOL.md section 17 lists them
all; ``tests/unit/test_rpc.py`` holds that list against :func:`all_rpcs`.

Every params and result Struct derives from :class:`Schema`: defaults left
off the wire, unknown keys ignored (so newer peers can add fields).

How to add an RPC
-----------------
1. In the capability's module here, define its params and result Structs
   (deriving from :class:`Schema`, every field bounded with ``msgspec.Meta``
   so decoding refuses absurd values) and declare it at the module's end:
   ``FROB = Rpc("files.frob", FrobParams, FrobResult)``; add it to the
   module's ``RPCS``.
2. In execd's capability module, write the handler named after the method
   (``files.frob`` is ``files_frob``), annotated with the declared params
   and result types; the capability's ``methods()`` (``bind(self,
   files.RPCS)``) picks it up.
3. In ``harnessd/api.py`` (or ``api_services.py``), add the typed client
   method, its keywords named and typed after the params' fields, and build
   the params with them: ``files.FrobParams(path=path, depth=depth)`` (mypy
   checks each keyword; ``tests/unit/test_rpc.py`` holds each argument's
   annotation to its field's).
4. Document it in PROTOCOL.md section 15 and add its row to section 17.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

P = TypeVar("P")
R = TypeVar("R")


class Schema(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """Base of every params and result Struct: the one schema configuration.

    msgspec passes ``omit_defaults`` and ``forbid_unknown_fields`` on to
    subclasses; ``kw_only`` it does not (it concerns a class's own fields), so
    a subclass whose required fields follow inherited defaults says
    ``kw_only=True`` itself.
    """


class Rpc(msgspec.Struct, Generic[P, R], frozen=True):
    """One method: its wire name, the type of its params and of its result."""

    name: str
    params: type[P]
    result: type[R]

    def __str__(self) -> str:
        return self.name


def all_rpcs() -> tuple[Rpc[Any, Any], ...]:
    """Every RPC declared here, capability by capability."""
    from protocol.rpc import (
        core,
        files,
        ledger,
        request,
        services,
        sessions,
        shell,
        terminal,
        watch,
    )

    modules = (core, files, shell, ledger, services, sessions, watch, terminal, request)
    return tuple(rpc for module in modules for rpc in module.RPCS)
