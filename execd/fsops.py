"""Blocking filesystem operations behind the ``files.*`` handlers.

Everything here is synchronous: :mod:`execd.files` runs these functions in
worker threads, one bounded unit of work per call, and maps the ``OSError``
they raise to typed errors with :func:`execd.errors.from_oserror`. Conditions
without an errno raise a typed :class:`execd.errors.ExecdError` directly.

Functions that may run for long (listing a tree, copying across filesystems)
take a :class:`threading.Event`; once it is set they stop between two units of
work by raising :class:`Interrupted`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from execd.errors import CrossDevice, InvalidPath, NotSupported
from protocol.rpc.files import FileType, ListEntry, ListResult, StatResult
from protocol.rpc.types import MAX_PATH

BLOCK = 1024 * 1024
"""Unit of file I/O: one read, write or hash step per worker-thread call."""

MAX_UNREADABLE = 100
"""How many unreadable subdirectories a listing names at most."""

ENTRY_OVERHEAD = 64
"""Generous estimate of the encoded size of a list entry, path excluded."""

_TEMP_ATTEMPTS = 16
_TEMP_PREFIX_CHARS = 32
#: This process's first choice of a temporary's name (a random tag made once): the same name
#: each time, so a directory written to again and again does not gather a new name (and, once
#: renamed away, a negative dentry) per write; the name does not hide anything, O_EXCL is what
#: makes it safe. When it is taken (a concurrent write to the same target, or anybody's file
#: there), fresh random names are tried.
_TEMP_TAG = secrets.token_hex(8)

#: Largest replaced file an atomic write may keep open past its rename (see
#: :meth:`FileSink.take_replaced`). The last close of a removed file frees it; on ext4 that
#: takes ~0.1 ms up to here, more above (0.3 ms for 1 MiB, 2 ms for 8 MiB): beyond this
#: size the rename frees it, wherever the commit runs.
KEEP_REPLACED_MAX = 128 * 1024

_T = TypeVar("_T")


class Interrupted(Exception):
    """A long operation noticed its cancel event and stopped."""


def check_path(path: str) -> str:
    """Return ``path`` if it can name a file at all, else raise InvalidPath."""
    if not path:
        raise InvalidPath("empty path", {"path": path})
    if "\x00" in path:
        raise InvalidPath("path contains a NUL character", {"path": path.replace("\x00", "\\0")})
    if len(path) > MAX_PATH:
        raise InvalidPath(f"path longer than {MAX_PATH} characters", {"length": len(path)})
    return path


def _error(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


def _printable(name: str) -> str:
    """``name`` as valid UTF-8 text (undecodable bytes become U+FFFD)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def file_type(mode: int) -> FileType:
    """The protocol's name for the file type in ``st_mode``."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


# -- reading -----------------------------------------------------------------------


def open_for_read(path: str) -> tuple[int, os.stat_result]:
    """Open a regular file for reading; return its descriptor and ``fstat``.

    A directory raises EISDIR; other non-regular files (FIFOs, devices,
    sockets) raise NotSupported. ``O_NONBLOCK`` keeps the open of a FIFO from
    hanging; it is cleared again for regular files.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise _error(errno.EISDIR, path)
        if not stat.S_ISREG(info.st_mode):
            raise NotSupported(f"not a regular file: {path}", {"path": path})
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def read_block(fd: int, size: int, offset: int, hasher: hashlib._Hash | None) -> bytes:
    """Read up to ``size`` bytes at ``offset`` and feed them to ``hasher`` if given."""
    data = os.pread(fd, size, offset)
    if hasher is not None:
        hasher.update(data)
    return data


def hash_block(fd: int, offset: int, hasher: hashlib._Hash) -> int:
    """Hash the next :data:`BLOCK` bytes at ``offset``; return how many there were."""
    return len(read_block(fd, BLOCK, offset, hasher))


# -- writing -----------------------------------------------------------------------


def _create_exclusive(
    target: str, create: Callable[[str], _T], attempts: int = _TEMP_ATTEMPTS
) -> tuple[str, _T]:
    """Create a fresh hidden sibling of ``target`` with ``create(name)``.

    ``create`` must fail with FileExistsError when the name is taken (O_EXCL,
    mkdir, symlink); the first name is the process's own (:data:`_TEMP_TAG`),
    then random ones are tried.
    If ``create`` fails any other way, whatever it left under the name is
    removed before the error propagates.
    """
    # The name os.path.split and os.path.join would make (a repeated slash aside), for less.
    head, slash, base = target.rpartition("/")
    directory = head + slash
    prefix = base[:_TEMP_PREFIX_CHARS]
    for attempt in range(attempts):
        tag = _TEMP_TAG if attempt == 0 else secrets.token_hex(8)
        name = f"{directory}.{prefix}.{tag}.tmp"
        try:
            return name, create(name)
        except FileExistsError as exc:
            if name in (exc.filename, exc.filename2):
                continue
            _discard(name)
            raise
        except BaseException:
            _discard(name)
            raise
    raise _error(errno.EEXIST, target)


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable, where the filesystem allows it."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _not_regular(path: str) -> NotSupported:
    return NotSupported(f"not a regular file: {path}", {"path": path})


def _open_regular_for_write(path: str, *, append: bool) -> tuple[int, os.stat_result]:
    """Open (creating) a regular file for writing, without ever waiting; its fd and fstat.

    ``O_NONBLOCK`` makes the open of a FIFO without a reader fail at once
    (ENXIO) instead of hanging; any non-regular file is refused before a
    byte is written. The flag is cleared again for the regular file. The
    file is not truncated here (see :class:`FileSink`).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
    if append:
        flags |= os.O_APPEND
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise _not_regular(path) from None
        raise
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise _error(errno.EISDIR, path)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


class FileSink:
    """Destination of the bytes of one ``files.write``.

    Theory of operation. States: *new* -> (``open``) *open* -> (``commit``)
    *committed*, or -> (``abort``) *aborted*; ``abort`` in any state is safe
    and does nothing once committed.

    * Atomic mode: ``open`` resolves a symlinked target to the file it names,
      refuses a directory target, and creates a temporary file beside the
      target (random hidden name, ``O_EXCL``). ``write`` appends blocks to the
      temporary. ``commit`` gives it the final mode (the requested one, else
      the old target's, else the umask default) and the old owner when allowed,
      fsyncs it and renames it over the target: the fsync before the rename
      means no crash can leave the target naming a file whose data never
      reached the disk (it holds the old content or the new). A *durable* sink
      then fsyncs the directory too, so that the rename itself survives a
      crash once ``commit`` returns (without it the old content may come
      back); that second fsync is a second journal commit on ext4, so it is
      asked for, not the default.
      ``abort`` closes and unlinks the temporary: the target is never touched
      before the rename, so a failure at any point leaves it as it was.
      A sink made with ``keep_replaced`` holds the file it replaces (an
      ``O_PATH`` descriptor, when that file is regular and at most
      :data:`KEEP_REPLACED_MAX` bytes) past the rename, so the rename only
      unlinks a name and the file is freed when the caller closes what
      :meth:`take_replaced` hands over (execd: once the call is answered);
      ``abort`` closes it otherwise.
    * Plain mode: ``open`` opens the target itself, for writing from its
      start or for appending. Writing from the start overwrites the old
      content and ``commit`` (or ``abort``) then truncates the file to the
      bytes written, rather than opening it with ``O_TRUNC``: ext4 writes a
      file truncated to zero back to disk when it is closed (0.2 ms for 4 KiB
      here), to spare it a zero-length state after a crash. ``commit`` closes
      it, after an fsync when the sink is durable. A failure leaves what was
      written.

    Only regular files are written: an existing target that is a FIFO, a
    device or a socket raises NotSupported (in plain mode the open is
    non-blocking, so a FIFO without a reader cannot hang it).
    """

    def __init__(
        self,
        path: str,
        *,
        atomic: bool,
        append: bool,
        mode: int | None,
        create_parents: bool,
        checksum: bool = True,
        durable: bool = False,
        keep_replaced: bool = False,
    ) -> None:
        self._path = path
        self._keep_replaced = keep_replaced
        #: O_PATH descriptor of the file the rename replaces (see the class description).
        self._replaced: int | None = None
        self._atomic = atomic
        self._durable = durable
        self._append = append
        self._mode = mode
        self._create_parents = create_parents
        self._fd: int | None = None
        self._temp: str | None = None
        self._target = path
        self._final_mode: int | None = mode
        self._owner: tuple[int, int] | None = None
        self._hasher = hashlib.sha256() if checksum else None
        self._size = 0
        self._device: int | None = None
        #: Owner (uid, gid) the temporary was created with (atomic mode).
        self._created_owner: tuple[int, int] | None = None

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    @property
    def device(self) -> int | None:
        """``st_dev`` of the file being written, once open."""
        return self._device

    def hexdigest(self) -> str:
        """SHA-256 (hex) of the bytes written so far."""
        return self._hasher.hexdigest() if self._hasher is not None else ""

    def open(self) -> None:
        """Prepare the destination (see the class description)."""
        if self._create_parents:
            parent = os.path.dirname(self._path)
            if parent:
                os.makedirs(parent, exist_ok=True)
        if not self._atomic:
            self._fd, info = _open_regular_for_write(self._path, append=self._append)
            self._device = info.st_dev
            if self._mode is not None:
                os.fchmod(self._fd, self._mode)
            return
        # One lstat answers both "is it a symlink?" and, for the common plain
        # file, "what is there now?"; only a symlink costs a second stat.
        old = self._look_at_target()
        if old is not None and stat.S_ISLNK(old.st_mode):
            self._target = os.path.realpath(self._path)
            try:
                old = os.stat(self._target)
            except FileNotFoundError:
                old = None
        if old is not None:
            if stat.S_ISDIR(old.st_mode):
                raise _error(errno.EISDIR, self._path)
            if not stat.S_ISREG(old.st_mode):
                raise _not_regular(self._path)
            self._owner = (old.st_uid, old.st_gid)
            if self._final_mode is None:
                self._final_mode = stat.S_IMODE(old.st_mode)
        # A brand-new file without a requested mode gets the umask default, as
        # any newly created file would; otherwise the temporary stays private
        # until commit gives it its final mode.
        create_mode = 0o600 if self._final_mode is not None else 0o666
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        self._temp, fd = _create_exclusive(
            self._target, lambda name: os.open(name, flags, create_mode)
        )
        self._fd = fd
        created = os.fstat(fd)
        self._device = created.st_dev
        self._created_owner = (created.st_uid, created.st_gid)

    def _look_at_target(self) -> os.stat_result | None:
        """The lstat of the target (None when there is none); held open if it may be kept."""
        if not self._keep_replaced:
            try:
                return os.lstat(self._path)
            except FileNotFoundError:
                return None
        try:
            fd = os.open(self._path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            info = os.fstat(fd)  # of the symlink itself, if it is one (O_NOFOLLOW)
        except BaseException:
            os.close(fd)
            raise
        if stat.S_ISREG(info.st_mode) and info.st_size <= KEEP_REPLACED_MAX:
            self._replaced = fd
        else:
            os.close(fd)
        return info

    def take_replaced(self) -> int | None:
        """Hand over the descriptor holding the replaced file, once committed (else None).

        The caller closes it; its last close frees the file the rename
        replaced.
        """
        if self._fd is not None or self._temp is not None:
            return None  # not committed: abort closes it
        fd, self._replaced = self._replaced, None
        return fd

    def preallocate(self, size: int) -> None:
        """Reserve ``size`` bytes up front so a full disk fails before any data moves."""
        if not self._atomic or size <= 0 or self._fd is None:
            return
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` (looping over short writes) and hash it."""
        if self._fd is None:
            raise ValueError("write on a sink that is not open")
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            if written <= 0:
                raise _error(errno.EIO, self._path)
            view = view[written:]
        if self._hasher is not None:
            self._hasher.update(data)
        self._size += len(data)

    def commit(self) -> None:
        """Make the written content visible at the target (see the class description)."""
        fd = self._fd
        if fd is None:
            raise ValueError("commit on a sink that is not open")
        if self._temp is None:
            if not self._append:
                os.ftruncate(fd, self._size)
            if self._durable:
                os.fsync(fd)
            self._fd = None
            os.close(fd)
            return
        # The temporary is this sink's own fresh file: its owner is still the
        # one fstat saw when ``open`` created it.
        if self._owner is not None and self._created_owner != self._owner:
            with contextlib.suppress(PermissionError):
                os.fchown(fd, *self._owner)
        if self._final_mode is not None:
            os.fchmod(fd, self._final_mode)
        # Data, owner and mode on disk before any name points at them.
        os.fsync(fd)
        self._fd = None
        os.close(fd)
        os.rename(self._temp, self._target)
        self._temp = None
        if self._durable:
            # The rename is durable only once its directory is.
            _fsync_directory(os.path.dirname(self._target))

    def abort(self) -> None:
        """Release the destination; in atomic mode remove the temporary. Never raises."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                if self._temp is None and not self._append:
                    os.ftruncate(fd, self._size)
            with contextlib.suppress(OSError):
                os.close(fd)
        temp, self._temp = self._temp, None
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        replaced, self._replaced = self._replaced, None
        if replaced is not None:
            with contextlib.suppress(OSError):
                os.close(replaced)


# -- metadata ------------------------------------------------------------------------


def stat_path(path: str, follow_symlinks: bool) -> StatResult:
    """Describe ``path``; a symlink's content is reported in ``target`` either way."""
    info = os.lstat(path)
    target: str | None = None
    if stat.S_ISLNK(info.st_mode):
        target = _printable(os.readlink(path))
        if follow_symlinks:
            info = os.stat(path)
    return StatResult(
        type=file_type(info.st_mode),
        size=info.st_size,
        mode=stat.S_IMODE(info.st_mode),
        mtime=info.st_mtime,
        mtime_ns=info.st_mtime_ns,
        uid=info.st_uid,
        gid=info.st_gid,
        target=target,
    )


def change_mode(path: str, mode: int) -> int:
    """Set the permission bits of ``path``; return them as they are afterwards."""
    os.chmod(path, mode)
    return stat.S_IMODE(os.stat(path).st_mode)


def make_directory(path: str, parents: bool, exist_ok: bool, mode: int | None) -> bool:
    """Create a directory; return False when it already existed (and ``exist_ok``)."""
    try:
        if parents:
            os.makedirs(path, 0o777)
        else:
            os.mkdir(path, 0o777)
    except FileExistsError:
        if exist_ok and os.path.isdir(path):
            return False
        raise
    if mode is not None:
        os.chmod(path, mode)
    return True


def remove_path(path: str, recursive: bool, missing_ok: bool) -> bool:
    """Remove a file, symlink or directory; return False when it was missing."""
    if not os.path.abspath(path).strip("/"):
        raise InvalidPath("refusing to remove the root directory", {"path": path})
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        if missing_ok:
            return False
        raise
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(path)
    elif recursive:
        shutil.rmtree(path)
    else:
        try:
            os.rmdir(path)
        except OSError as exc:
            # POSIX lets rmdir report a non-empty directory as EEXIST.
            if exc.errno == errno.EEXIST:
                raise _error(errno.ENOTEMPTY, path) from None
            raise
    return True


# -- listing -------------------------------------------------------------------------


def _sorted_entries(path: str) -> list[os.DirEntry[str]]:
    with os.scandir(path) as it:
        entries = list(it)
    entries.sort(key=lambda entry: entry.name)
    return entries


def list_directory(
    path: str,
    cancel: threading.Event,
    *,
    recursive: bool,
    limit: int,
    include_hidden: bool,
    byte_budget: int,
) -> ListResult:
    """List ``path`` depth-first in name order, stopping at ``limit`` entries.

    Symlinks are reported, never followed, so recursion cannot loop. The
    listing is also cut (``truncated``) before its estimated encoded size
    exceeds ``byte_budget``; names of unreadable subdirectories count against
    the budget too (those beyond it are not named).
    """
    stack: list[tuple[str, Iterator[os.DirEntry[str]]]] = [("", iter(_sorted_entries(path)))]
    entries: list[ListEntry] = []
    unreadable: list[str] = []
    skipped = 0
    spent = 0
    while stack:
        prefix, pending = stack[-1]
        entry = next(pending, None)
        if entry is None:
            stack.pop()
            continue
        if not include_hidden and entry.name.startswith("."):
            continue
        if not _is_utf8(entry.name):
            skipped += 1
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        relative = prefix + entry.name
        cost = len(relative.encode()) + ENTRY_OVERHEAD
        if len(entries) >= limit or spent + cost > byte_budget:
            return ListResult(
                entries=entries, truncated=True, unreadable=unreadable, skipped=skipped
            )
        spent += cost
        entries.append(
            ListEntry(
                path=relative,
                type=file_type(info.st_mode),
                size=info.st_size,
                mtime=info.st_mtime,
                mode=stat.S_IMODE(info.st_mode),
            )
        )
        if recursive and stat.S_ISDIR(info.st_mode):
            if cancel.is_set():
                raise Interrupted
            try:
                children = _sorted_entries(entry.path)
            except OSError:
                cost = len(relative.encode()) + 8
                if len(unreadable) < MAX_UNREADABLE and spent + cost <= byte_budget:
                    unreadable.append(relative)
                    spent += cost
                continue
            stack.append((relative + "/", iter(children)))
    return ListResult(entries=entries, unreadable=unreadable, skipped=skipped)


# -- moving --------------------------------------------------------------------------


def _copy_contents(source: int, dest: int, cancel: threading.Event) -> None:
    """Copy all of ``source`` into ``dest`` a block at a time."""
    offset = 0
    use_sendfile = True
    while True:
        if cancel.is_set():
            raise Interrupted
        if use_sendfile:
            try:
                copied = os.sendfile(dest, source, offset, 8 * BLOCK)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                use_sendfile = False
                continue
        else:
            data = os.pread(source, BLOCK, offset)
            view = memoryview(data)
            while view:
                view = view[os.write(dest, view) :]
            copied = len(data)
        if copied == 0:
            return
        offset += copied


def _copy_file(source: str, dest: str, cancel: threading.Event, *, durable: bool) -> None:
    """Copy a regular file to the new name ``dest`` keeping its mode and times."""
    src_fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(src_fd)
        if not stat.S_ISREG(info.st_mode):
            raise CrossDevice(f"cannot copy a special file across filesystems: {source}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        dst_fd = os.open(dest, flags, 0o600)
        try:
            _copy_contents(src_fd, dst_fd, cancel)
            os.fchmod(dst_fd, stat.S_IMODE(info.st_mode))
            os.utime(dst_fd, ns=(info.st_atime_ns, info.st_mtime_ns))
            if durable:
                os.fsync(dst_fd)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def _copy_tree(source: str, dest: str, cancel: threading.Event) -> None:
    """Copy a directory tree to the new name ``dest``; symlinks are copied as links."""
    os.mkdir(dest, 0o700)
    copied_dirs = [(source, dest)]
    stack = [(source, dest)]
    while stack:
        src_dir, dst_dir = stack.pop()
        for entry in _sorted_entries(src_dir):
            if cancel.is_set():
                raise Interrupted
            target = os.path.join(dst_dir, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
            elif entry.is_dir(follow_symlinks=False):
                os.mkdir(target, 0o700)
                stack.append((entry.path, target))
                copied_dirs.append((entry.path, target))
            elif entry.is_file(follow_symlinks=False):
                _copy_file(entry.path, target, cancel, durable=False)
            else:
                raise CrossDevice(f"cannot copy a special file across filesystems: {entry.path}")
    # Children first, so setting a parent's times is not undone by later writes.
    for src_dir, dst_dir in reversed(copied_dirs):
        info = os.lstat(src_dir)
        os.chmod(dst_dir, stat.S_IMODE(info.st_mode))
        os.utime(dst_dir, ns=(info.st_atime_ns, info.st_mtime_ns))


def _discard(path: str) -> None:
    """Remove a partial copy; never raises."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def move_path(src: str, dst: str, overwrite: bool, cancel: threading.Event) -> bool:
    """Rename ``src`` to ``dst``; across filesystems copy, then remove ``src``.

    Same filesystem: one ``rename(2)``, with its semantics (a file replaces a
    file, a directory replaces only an empty directory). Across filesystems
    the content is copied to a hidden sibling of ``dst``, renamed into place
    (so ``dst`` appears complete or not at all) and ``src`` is removed last;
    if that removal fails the error is raised with ``dst`` already complete.
    Special files cannot cross filesystems (CrossDevice). Returns whether data
    was copied. Without ``overwrite`` an existing ``dst`` raises EEXIST (the
    check and the rename are two steps).
    """
    info = os.lstat(src)
    if not overwrite and os.path.lexists(dst):
        raise _error(errno.EEXIST, dst)
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    else:
        return False
    dst = dst.rstrip("/") or "/"
    if stat.S_ISLNK(info.st_mode):
        link = os.readlink(src)

        def create(name: str) -> None:
            os.symlink(link, name)
    elif stat.S_ISDIR(info.st_mode):

        def create(name: str) -> None:
            _copy_tree(src, name, cancel)
    elif stat.S_ISREG(info.st_mode):

        def create(name: str) -> None:
            _copy_file(src, name, cancel, durable=True)
    else:
        raise CrossDevice(f"cannot move a special file across filesystems: {src}", {"path": src})
    temp, _ = _create_exclusive(dst, create)
    try:
        if not overwrite and os.path.lexists(dst):
            raise _error(errno.EEXIST, dst)
        os.rename(temp, dst)
    except BaseException:
        _discard(temp)
        raise
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(src)
    else:
        os.unlink(src)
    return True
