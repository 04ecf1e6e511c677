"""The workspace's files and execd's session ledgers as MCP resources.

URIs
----
``workspace://`` + an absolute path in the workspace, percent-encoded
(``workspace:///work/src/main.py``): a file reads as its text (or base64
bytes when it is not UTF-8), at most ``read_cap`` bytes of it; a directory
reads as its listing. ``ledger:///NAME`` is the session ledger ``NAME``:
one JSON object per line (``seq``, ``hash``, ``entry``), at most
:data:`LEDGER_ENTRIES` entries from ``?from=SEQ`` (default 1), then a last
line ``{"more_from": SEQ}`` when there are more.

``resources/list`` names the ledgers execd keeps (this server's own first)
and the files under the workspace root (at most ``list_limit``).

Subscriptions
-------------
A subscription to a URI is an execd watch (``watch.subscribe``) on the
directory that holds it, debounced: a change to the file (written, replaced
by a rename, deleted, its metadata changed), to a directory's entries, or to
a ledger's index (each committed append) sends
``notifications/resources/updated`` for the URI. At most
:data:`MAX_SUBSCRIPTIONS` are held at once; each ends with its MCP session,
on unsubscribe, or when execd ends the watch.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import mimetypes
import posixpath
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import mcp_types as types
import msgspec

from harnessd.api import ExecdClient
from harnessd.api_watch import PathWatch
from harnessd.errors import HarnessError
from harnessd.ledger_sync import decode_entry
from harnessd.mcp.catalog import ConfinedToolbox
from harnessd.models import ToolCall
from harnessd.tool_text import ToolFailed
from protocol.rpc import watch as watch_rpc

log = logging.getLogger("harnessd.mcp")

FILE_SCHEME = "workspace"
LEDGER_SCHEME = "ledger"

LEDGER_ENTRIES = 500
"""Most ledger entries one read returns."""

LEDGER_CHARS = 1024 * 1024
"""Most characters of ledger text one read returns (whole entries)."""

MAX_SUBSCRIPTIONS = 64
"""Resource subscriptions held at once, over all MCP sessions."""

WATCH_DEBOUNCE = 0.05
"""Seconds over which a burst of changes to one path makes one notification."""

_INDEX_SUFFIX = ".index"


class ResourceError(ValueError):
    """A URI this server does not serve, or one it cannot read."""


@dataclass(frozen=True, slots=True)
class FileRef:
    """``workspace://PATH``."""

    path: str


@dataclass(frozen=True, slots=True)
class LedgerRef:
    """``ledger:///NAME?from=SEQ``."""

    name: str
    first: int = 1


def file_uri(path: str) -> str:
    """The URI of an absolute workspace path."""
    return f"{FILE_SCHEME}://{urllib.parse.quote(path, safe='/')}"


def ledger_uri(name: str) -> str:
    """The URI of the session ledger ``name``."""
    return f"{LEDGER_SCHEME}:///{name}"


def parse(uri: str) -> FileRef | LedgerRef:
    """What ``uri`` names; ResourceError for anything else."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme == FILE_SCHEME and not parts.netloc and parts.path.startswith("/"):
        path = urllib.parse.unquote(parts.path)
        if "\0" in path:
            raise ResourceError(f"{uri}: a path cannot hold NUL")
        return FileRef(posixpath.normpath(path))
    if parts.scheme == LEDGER_SCHEME and not parts.netloc:
        name = parts.path.lstrip("/")
        query = urllib.parse.parse_qs(parts.query)
        first = query.get("from", ["1"])[-1]
        if not (name and first.isascii() and first.isdigit() and int(first) >= 1):
            raise ResourceError(f"{uri}: expected ledger:///NAME or ledger:///NAME?from=SEQ")
        return LedgerRef(name, int(first))
    raise ResourceError(
        f"{uri}: not a resource of this server (workspace:///ABSOLUTE/PATH or ledger:///NAME)"
    )


TEMPLATES = [
    types.ResourceTemplate(
        name="workspace-file",
        uri_template=f"{FILE_SCHEME}://{{+path}}",
        description="A file (its content) or directory (its listing) of the workspace, by "
        "absolute path.",
    ),
    types.ResourceTemplate(
        name="session-ledger",
        uri_template=f"{LEDGER_SCHEME}:///{{session}}",
        description="A session ledger kept by execd: one JSON entry per line, hash-chained.",
        mime_type="application/x-ndjson",
    ),
]


class WorkspaceResources:
    """Lists, reads and watches the resources of one workspace."""

    def __init__(
        self,
        client: Callable[[], ExecdClient],
        box: ConfinedToolbox,
        *,
        journal: str,
    ) -> None:
        self._client = client
        self._box = box
        self._journal = journal
        self._ledger_dir: str | None = None
        self._subscriptions: dict[tuple[str, str], asyncio.Task[None]] = {}

    # -- listing and reading -----------------------------------------------------------

    async def list(self) -> list[types.Resource]:
        """This server's ledger, the other ledgers, then the files under the root."""
        client = self._client()
        listed = [
            types.Resource(
                name=self._journal,
                uri=ledger_uri(self._journal),
                description="This server's session ledger: every tool call and its result.",
                mime_type="application/x-ndjson",
            )
        ]
        for info in (await client.ledger_sessions()).sessions:
            if info.session != self._journal:
                listed.append(
                    types.Resource(
                        name=info.session,
                        uri=ledger_uri(info.session),
                        description=f"Session ledger {info.session} ({info.seq} entries).",
                        mime_type="application/x-ndjson",
                    )
                )
        root = self._box.config.root
        if root is not None:
            entries = await client.list_dir(root, recursive=True, limit=self._box.config.list_limit)
            for entry in entries.entries:
                if entry.type == "file":
                    path = posixpath.join(root, entry.path)
                    listed.append(
                        types.Resource(
                            name=entry.path,
                            uri=file_uri(path),
                            mime_type=mimetypes.guess_type(entry.path)[0],
                            size=entry.size,
                        )
                    )
        return listed

    async def read(self, uri: str) -> types.ReadResourceResult:
        """The content of ``uri``; ResourceError or the typed HarnessError when it fails."""
        ref = parse(uri)
        if isinstance(ref, LedgerRef):
            text = await self._read_ledger(ref)
            contents = types.TextResourceContents(
                uri=uri, text=text, mime_type="application/x-ndjson"
            )
            return types.ReadResourceResult(contents=[contents])
        return types.ReadResourceResult(contents=[await self._read_path(uri, ref.path)])

    async def _read_path(
        self, uri: str, path: str
    ) -> types.TextResourceContents | types.BlobResourceContents:
        path = self._checked(path)
        client = self._client()
        if (await client.stat(path)).type == "dir":
            # The list_files tool's listing, as a model reads it.
            arguments = msgspec.json.encode({"path": path}).decode()
            shown = await self._box.call(ToolCall(id=uri, name="list_files", arguments=arguments))
            if not shown.ok:
                raise ResourceError(shown.text)
            return types.TextResourceContents(uri=uri, text=shown.text, mime_type="text/plain")
        cap = self._box.config.read_cap
        data = await client.read_file(path, length=cap + 1)
        meta = {"truncated": True, "bytes": cap} if len(data) > cap else None
        data = data[:cap]
        mime = mimetypes.guess_type(path)[0]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            blob = base64.b64encode(data).decode()
            return types.BlobResourceContents(
                uri=uri, blob=blob, mime_type=mime or "application/octet-stream", _meta=meta
            )
        return types.TextResourceContents(
            uri=uri, text=text, mime_type=mime or "text/plain", _meta=meta
        )

    def _checked(self, path: str) -> str:
        try:
            return self._box.path(path)
        except ToolFailed as exc:
            raise ResourceError(str(exc)) from None

    async def _read_ledger(self, ref: LedgerRef) -> str:
        records = await self._client().ledger_read(ref.name, ref.first, limit=LEDGER_ENTRIES + 1)
        lines: list[str] = []
        size = 0
        more: int | None = None
        for index, record in enumerate(records):
            if index == LEDGER_ENTRIES:
                more = record.seq
                break
            try:
                entry: object = decode_entry(record.payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                entry = {"bytes": base64.b64encode(record.payload).decode()}
            line = msgspec.json.encode(
                {"seq": record.seq, "hash": record.hash.hex(), "entry": entry}, enc_hook=_plain
            ).decode()
            if lines and size + len(line) > LEDGER_CHARS:
                more = record.seq
                break
            lines.append(line)
            size += len(line) + 1
        if more is not None:
            lines.append(msgspec.json.encode({"more_from": more}).decode())
        return "\n".join(lines)

    # -- subscriptions -----------------------------------------------------------------

    async def subscribe(
        self, owner: str, uri: str, notify: Callable[[str], Awaitable[None]]
    ) -> None:
        """Watch ``uri`` for ``owner`` (an MCP session); ``notify(uri)`` on each change."""
        key = (owner, uri)
        if key in self._subscriptions:
            return
        if len(self._subscriptions) >= MAX_SUBSCRIPTIONS:
            raise ResourceError(f"{MAX_SUBSCRIPTIONS} subscriptions are held; unsubscribe first")
        directory, target = await self._watched(parse(uri))
        watch = await self._client().watch(directory, debounce=WATCH_DEBOUNCE)
        task = asyncio.get_running_loop().create_task(self._follow(watch, uri, target, notify))
        self._subscriptions[key] = task
        task.add_done_callback(lambda _: self._forget(key, task))

    async def unsubscribe(self, owner: str, uri: str) -> None:
        """Stop watching ``uri`` for ``owner`` (nothing when not subscribed)."""
        task = self._subscriptions.pop((owner, uri), None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def unsubscribe_all(self, owner: str | None = None) -> None:
        """End the subscriptions of ``owner`` (every one when None)."""
        for key in [k for k in self._subscriptions if owner is None or k[0] == owner]:
            await self.unsubscribe(*key)

    def _forget(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._subscriptions.get(key) is task:
            del self._subscriptions[key]

    async def _watched(self, ref: FileRef | LedgerRef) -> tuple[str, str | None]:
        """The directory to watch and the path in it that matters (None: any entry)."""
        if isinstance(ref, LedgerRef):
            if self._ledger_dir is None:
                self._ledger_dir = (await self._client().server_info()).ledger_dir
            return self._ledger_dir, posixpath.join(self._ledger_dir, ref.name + _INDEX_SUFFIX)
        path = self._checked(ref.path)
        if (await self._client().stat(path)).type == "dir":
            return path, None
        return posixpath.dirname(path) or "/", path

    async def _follow(
        self,
        watch: PathWatch,
        uri: str,
        target: str | None,
        notify: Callable[[str], Awaitable[None]],
    ) -> None:
        try:
            async for kind, event in watch:
                if kind in watch_rpc.CHANGE_KINDS and not _concerns(event, target):
                    continue
                if kind in ("ended", "watch_limit", "watch_failed"):
                    continue
                await notify(uri)
        except (HarnessError, OSError) as exc:
            log.info("subscription to %s ended: %s", uri, exc)
        except Exception as exc:  # the subscriber's session is gone (its stream closed)
            log.info("subscription to %s ended: %s: %s", uri, type(exc).__name__, exc)
        finally:
            with contextlib.suppress(HarnessError, OSError):
                await watch.close()


def _concerns(event: watch_rpc.WatchEvent, target: str | None) -> bool:
    if target is None:
        return True
    return target in (event.path, event.from_path, event.to_path)


def _plain(value: object) -> object:
    """JSON for what a msgpack ledger entry may hold beyond JSON (bytes)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    raise TypeError(f"cannot encode {type(value).__name__}")
