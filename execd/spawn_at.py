"""``posix_spawn`` through :mod:`ctypes`: vectors and file actions kept, and a working directory.

``os.posix_spawn`` has no working-directory action (up to Python 3.13 at
least), although glibc has had ``posix_spawn_file_actions_addchdir_np`` since
2.29: the child changes directory after the stdio actions and before exec,
and a failed ``chdir`` comes back as the call's errno exactly like a failed
exec. This module calls glibc's ``posix_spawn``/``posix_spawnp`` through
:mod:`ctypes` with the same actions :func:`execd.spawn._start` would give
``os.posix_spawn``, plus that one when a ``cwd`` is asked for.

What would make it cost more than ``os.posix_spawn`` is kept between calls:
the last ``envp`` vector (reused for the very same variables), initialized
spawn attributes, and initialized file actions for the descriptors and
directories of the latest spawns (a command's pipes mostly get the numbers
the previous command's had). ``python -m bench.spawn`` compares the two.

:func:`available` is false where the C library lacks the action (musl,
older glibc); callers then use ``os.posix_spawn`` or ``subprocess.Popen``.
:mod:`ctypes` is imported on the first use, not when execd starts.
"""

from __future__ import annotations

import array
import errno
import itertools
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final

# glibc's <spawn.h> flags (the same on every Linux architecture).
_SETSIGDEF: Final = 0x04
_SETSID: Final = 0x80
#: Room for glibc's posix_spawnattr_t (336 bytes on x86-64), file actions (80) and sigset_t (128).
_OPAQUE: Final = 1024
#: Initialized file actions kept (their descriptors and directory as the key); the oldest goes first.
_KEPT_ACTIONS: Final = 16

_POINTER_TYPE: Final = "Q"


class _Libc:
    """The C functions this module needs, resolved once."""

    def __init__(self) -> None:
        import ctypes

        self.ctypes = ctypes
        # Called by their C names: the CDLL keeps each function, with the
        # argtypes set here, after its first lookup. A C library without the
        # chdir action fails that lookup with AttributeError.
        self.c = c = ctypes.CDLL(None, use_errno=True)
        for function in (c.posix_spawn, c.posix_spawnp):
            function.argtypes = [
                ctypes.POINTER(ctypes.c_int),
                ctypes.c_char_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
        c.posix_spawnattr_setflags.argtypes = [ctypes.c_void_p, ctypes.c_short]
        c.posix_spawn_file_actions_addopen.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_uint,
        ]
        c.posix_spawn_file_actions_addchdir_np.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        if ctypes.sizeof(ctypes.c_void_p) != array.array(_POINTER_TYPE).itemsize:
            raise OSError(errno.ENOSYS, "pointers of an unexpected size")
        self.attributes: dict[tuple[bool, tuple[int, ...]], Any] = {}
        self.actions: dict[tuple[tuple[tuple[Any, ...], ...], str], Any] = {}
        self.opaque = ctypes.c_char * _OPAQUE
        #: The last environment (a copy, its names in order) and its vector: commands mostly repeat it.
        self.environment: (
            tuple[dict[str, str], list[str], tuple[int, array.array[int], array.array[int]]] | None
        ) = None


_libc: _Libc | None = None
_missing = False


def _load() -> _Libc | None:
    global _libc, _missing
    if _libc is None and not _missing:
        try:
            _libc = _Libc()
        except (OSError, AttributeError):
            _missing = True
    return _libc


def available() -> bool:
    """Whether the C library can change directory in a ``posix_spawn`` child."""
    return _load() is not None


def _vector(items: list[str]) -> tuple[int, array.array[int], array.array[int]]:
    """The address of a NULL-terminated ``char *[]`` holding ``items``, and what it points into.

    Both returned arrays must stay alive until the call that uses the
    address returns. One joined, encoded buffer and an ``array`` of the
    addresses in it, computed by C-level iterators: a ``c_char_p`` array built
    item by item costs ten times as much. Raises ValueError for a NUL in an item.
    """
    joined = "\0".join(items)
    if joined.count("\0") != max(len(items) - 1, 0):
        raise ValueError("embedded null byte")
    encoded = (joined + "\0").encode("utf-8", "surrogateescape")
    blob = array.array("B", encoded)
    base: int = blob.buffer_info()[0]
    lengths = map(len, encoded.split(b"\0")[: len(items) - 1])
    starts = map(operator.add, itertools.accumulate(lengths, initial=0), itertools.count(base))
    pointers = array.array(_POINTER_TYPE, starts if items else ())
    pointers.append(0)
    return pointers.buffer_info()[0], pointers, blob


def _environment(
    libc: _Libc, env: Mapping[str, str]
) -> tuple[int, array.array[int], array.array[int]]:
    """The ``envp`` vector of ``env``: the last one again when ``env`` holds the same entries.

    The same entries means the same names in the same order with the same
    values. Building it is most of this module's cost per spawn
    (python -m bench.spawn), and the commands of a session mostly share one
    environment. Raises ValueError for a name no environment can hold or a
    NUL byte.
    """
    last = libc.environment
    if last is not None and last[0] == env and list(env) == last[1]:
        return last[2]
    if "=" in "".join(env) or "" in env:
        raise ValueError("illegal environment variable name")
    vector = _vector(list(map("=".join, env.items())))
    libc.environment = (dict(env), list(env), vector)
    return vector


def _check(code: int) -> None:
    if code != 0:
        raise OSError(code, os.strerror(code))


def _attributes(libc: _Libc, setsid: bool, setsigdef: tuple[int, ...]) -> Any:
    """An initialized ``posix_spawnattr_t`` for these options, made once and kept."""
    key = (setsid, setsigdef)
    attr = libc.attributes.get(key)
    if attr is None:
        attr = libc.opaque()
        sigset = libc.opaque()
        _check(libc.c.posix_spawnattr_init(attr))
        flags = _SETSID if setsid else 0
        if setsigdef:
            libc.c.sigemptyset(sigset)
            for signum in setsigdef:
                libc.c.sigaddset(sigset, signum)
            _check(libc.c.posix_spawnattr_setsigdefault(attr, sigset))
            flags |= _SETSIGDEF
        _check(libc.c.posix_spawnattr_setflags(attr, flags))
        libc.attributes[key] = attr
    return attr


def _file_actions(libc: _Libc, file_actions: Sequence[tuple[Any, ...]], cwd: str) -> Any:
    """Initialized file actions for these stdio actions and ``cwd``, made once and kept.

    ``posix_spawn`` only reads them, and a command's pipes mostly get the
    descriptor numbers the previous command's had. The :data:`_KEPT_ACTIONS`
    latest are kept; the oldest is destroyed to make room.
    """
    key = (tuple(file_actions), cwd)
    kept = libc.actions.get(key)
    if kept is not None:
        return kept
    if "\0" in cwd:
        raise ValueError("embedded null byte")
    c = libc.c
    actions = libc.opaque()
    _check(c.posix_spawn_file_actions_init(actions))
    try:
        for action in file_actions:
            if action[0] == os.POSIX_SPAWN_DUP2:
                _check(c.posix_spawn_file_actions_adddup2(actions, action[1], action[2]))
            elif action[0] == os.POSIX_SPAWN_OPEN:
                _, fd, name, flags, mode = action
                _check(
                    c.posix_spawn_file_actions_addopen(actions, fd, os.fsencode(name), flags, mode)
                )
            else:
                raise ValueError(f"unsupported file action {action[0]}")
        _check(c.posix_spawn_file_actions_addchdir_np(actions, os.fsencode(cwd)))
    except BaseException:
        c.posix_spawn_file_actions_destroy(actions)
        raise
    if len(libc.actions) >= _KEPT_ACTIONS:
        oldest = next(iter(libc.actions))
        c.posix_spawn_file_actions_destroy(libc.actions.pop(oldest))
    libc.actions[key] = actions
    return actions


def spawn_in(
    path: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    cwd: str,
    file_actions: Sequence[tuple[Any, ...]],
    search: bool,
    setsid: bool,
    setsigdef: Sequence[int],
) -> int:
    """Start ``argv`` in ``cwd`` like ``os.posix_spawn[p]`` with the same options; its pid.

    ``file_actions`` take ``os.posix_spawn``'s tuple forms (only
    ``POSIX_SPAWN_DUP2`` and ``POSIX_SPAWN_OPEN``). ``search``: look
    ``path`` up in this process's ``PATH`` (``posix_spawnp``). Raises
    ``OSError`` with the errno of a failed ``chdir`` or exec, ``ValueError``
    for arguments no process can receive, as ``os.posix_spawn`` does.
    """
    libc = _load()
    if libc is None:
        raise OSError(errno.ENOSYS, "posix_spawn cannot change directory with this C library")
    ctypes, c = libc.ctypes, libc.c
    env_address, *env_keep = _environment(libc, env)
    if "\0" in path:
        raise ValueError("embedded null byte")
    program = os.fsencode(path)
    attr = _attributes(libc, setsid, tuple(setsigdef))
    actions = _file_actions(libc, file_actions, cwd)
    argv_address, *argv_keep = _vector(list(argv))
    pid = ctypes.c_int(0)
    function = c.posix_spawnp if search else c.posix_spawn
    _check(function(ctypes.byref(pid), program, actions, attr, argv_address, env_address))
    del argv_keep, env_keep
    return int(pid.value)
