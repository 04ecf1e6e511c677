"""The directories a recursive watch subscription mirrors, one inotify watch each.

A :class:`DirectoryTree` keeps the watched directories as a tree of
:class:`Node` (watch descriptor, entry name, parent) under the subscription's
root, and a table from watch descriptor to node. A path is never stored: it
is rebuilt from the names on the way up (:meth:`DirectoryTree.path_of`), so a
renamed directory keeps its watches and only its node moves
(:meth:`DirectoryTree.move`). The kernel shares one watch between every path
of an inode, so a directory reached again (a bind mount, or a rename seen
before its event) is moved to its new place rather than watched twice, and
never below itself.

New directories are watched first and scanned second (:meth:`DirectoryTree.walk`),
so an entry created between the two is either seen by the scan or reported by
the new watch. After lost kernel events :meth:`DirectoryTree.resync` re-learns
the tree from disk. The tree only keeps watches; what the subscription
reports, and what it does with a directory it cannot watch, is the owner's.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from typing import Final

from execd.errors import ExecdError, WatchLimit, from_oserror
from execd.inotify import InotifyHub, WatchUser

GONE_ERRNOS: Final = frozenset({errno.ENOENT, errno.ENOTDIR})
"""Errors of a watch on a directory that is gone or replaced already (its own event follows)."""


def watch_error(exc: OSError, path: str) -> ExecdError:
    """The typed error for a failed inotify_init1/inotify_add_watch."""
    if exc.errno == errno.ENOSPC:
        return WatchLimit(
            f"inotify watch limit reached (fs.inotify.max_user_watches): {path}",
            {"errno": "ENOSPC", "path": path},
        )
    if exc.errno == errno.EMFILE:
        return WatchLimit(
            "inotify instance limit reached (fs.inotify.max_user_instances)",
            {"errno": "EMFILE", "path": path},
        )
    return from_oserror(exc, path)


class Node:
    """A watched directory (the root has no parent)."""

    __slots__ = ("children", "name", "parent", "wd")

    def __init__(self, wd: int, name: str, parent: Node | None) -> None:
        self.wd = wd
        self.name = name
        self.parent = parent
        self.children: dict[str, Node] = {}


def _entry_is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


class DirectoryTree:
    """The watched directories below ``root``, held in ``hub`` on behalf of ``user``.

    ``unwatchable(path, error)`` is called for a directory whose watch could
    not be added.
    """

    def __init__(
        self,
        hub: InotifyHub,
        user: WatchUser,
        root: str,
        unwatchable: Callable[[str, OSError], None],
    ) -> None:
        self._hub = hub
        self._user = user
        self.root = root
        self._unwatchable = unwatchable
        self._nodes: dict[int, Node] = {}
        self.root_node: Node | None = None

    def __len__(self) -> int:
        """How many inotify watches the tree holds."""
        return len(self._nodes)

    def set_root(self, wd: int) -> Node:
        """Record the root's watch (added by the owner, who chose how to follow it)."""
        self.root_node = Node(wd, "", None)
        self._nodes[wd] = self.root_node
        return self.root_node

    def node(self, wd: int) -> Node | None:
        """The directory watched by ``wd``, if it is one of this tree's."""
        return self._nodes.get(wd)

    def path_of(self, node: Node) -> str:
        """The path of ``node`` now."""
        names: list[str] = []
        current: Node | None = node
        while current is not None and current.parent is not None:
            names.append(current.name)
            current = current.parent
        if not names:
            return self.root
        return os.path.join(self.root, *reversed(names))

    # -- changes the kernel reports --

    def add(self, parent: Node, name: str, path: str) -> tuple[Node | None, bool]:
        """Watch directory ``path`` (entry ``name`` of ``parent``).

        Returns the node and whether it is new; an inode already watched by
        this tree is moved to its new place instead (``None`` if that would
        make a cycle, as through a bind mount of an ancestor).
        """
        try:
            wd, _ = self._hub.acquire(self._user, path, follow=False, only_dir=True)
        except OSError as exc:
            self._unwatchable(path, exc)
            return None, False
        node = self._nodes.get(wd)
        if node is not None:
            if _is_within(parent, node):
                return None, False
            self._attach(node, parent, name)
            return node, False
        node = Node(wd, name, parent)
        self._nodes[wd] = node
        self._attach(node, parent, name)
        return node, True

    def remove(self, parent: Node, name: str) -> None:
        """Entry ``name`` of ``parent`` is gone: release its subtree, if watched."""
        gone = parent.children.pop(name, None)
        if gone is not None:
            self._release_subtree(gone)

    def move(self, source: Node, name: str, target: Node | None, new_name: str) -> bool:
        """Entry ``name`` of ``source`` became ``new_name`` of ``target`` (``None``: left the tree).

        Returns whether the watched subtree moved along; when it did not (it
        was not watched, or would land below itself), the caller watches the
        target afresh.
        """
        moving = source.children.pop(name, None)
        if target is None:
            if moving is not None:
                self._release_subtree(moving)
            return False
        if moving is not None and not _is_within(target, moving):
            self._attach(moving, target, new_name)
            return True
        if moving is not None:
            self._release_subtree(moving)
        return False

    def forget(self, wd: int) -> None:
        """The kernel dropped ``wd``: forget its directory and everything below."""
        node = self._nodes.get(wd)
        if node is not None:
            _detach(node)
            self._release_subtree(node)

    # -- scans --

    def walk(
        self,
        node: Node,
        path: str,
        *,
        found: Callable[[str, bool], None] | None = None,
        halted: Callable[[], bool],
    ) -> Iterator[None]:
        """Watch every directory below ``node``; yields after each directory.

        ``found(path, is_dir)`` hears of every entry before it is watched.
        The walk skips directories once ``halted()`` and stops as soon as it
        is true after adding a watch.
        """
        stack = [(node, path)]
        while stack:
            parent, parent_path = stack.pop()
            if self._nodes.get(parent.wd) is not parent or halted():
                continue
            try:
                with os.scandir(parent_path) as entries:
                    listing = [(entry.name, _entry_is_dir(entry)) for entry in entries]
            except OSError:
                continue
            for name, is_dir in listing:
                child_path = os.path.join(parent_path, name)
                if found is not None:
                    found(child_path, is_dir)
                if is_dir:
                    child, fresh = self.add(parent, name, child_path)
                    if child is not None and fresh:
                        stack.append((child, child_path))
                    if halted():
                        return
            yield

    def resync(self) -> None:
        """Re-learn the tree from disk after lost events (nothing is reported)."""
        root = self.root_node
        if root is None:
            return
        seen = {root.wd}
        stack = [(root, self.root)]
        while stack:
            parent, parent_path = stack.pop()
            try:
                with os.scandir(parent_path) as entries:
                    dirs = [entry.name for entry in entries if _entry_is_dir(entry)]
            except OSError:
                continue
            for name in dirs:
                child, _ = self.add(parent, name, os.path.join(parent_path, name))
                if child is not None and child.wd not in seen:
                    seen.add(child.wd)
                    stack.append((child, os.path.join(parent_path, name)))
        for wd, node in list(self._nodes.items()):
            if wd not in seen and self._nodes.get(wd) is node:
                _detach(node)
                self._release_subtree(node)

    # -- the nodes --

    def _attach(self, node: Node, parent: Node, name: str) -> None:
        _detach(node)
        old = parent.children.get(name)
        if old is not None and old is not node:
            self._release_subtree(old)
        node.parent, node.name = parent, name
        parent.children[name] = node

    def _release_subtree(self, node: Node) -> None:
        stack = [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            current.children.clear()
            if self._nodes.get(current.wd) is current:
                del self._nodes[current.wd]
                self._hub.release(self._user, current.wd)


def _is_within(node: Node, ancestor: Node) -> bool:
    current: Node | None = node
    while current is not None:
        if current is ancestor:
            return True
        current = current.parent
    return False


def _detach(node: Node) -> None:
    parent = node.parent
    if parent is not None and parent.children.get(node.name) is node:
        del parent.children[node.name]
