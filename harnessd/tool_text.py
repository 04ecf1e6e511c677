"""The text a tool gives the model: results formatted, output cut to a cap, errors named.

What the model reads of a command, a session run or a service is made here,
from execd's results: collected output as text with how much was dropped,
a head and a tail kept of what was cut (:class:`HeadTail`, as execd keeps
them in collected mode), and a failure as ``error: <Type> (code N): message``.
"""

from __future__ import annotations

from harnessd.errors import RemoteError
from protocol.rpc import services, sessions, shell


class ToolFailed(Exception):
    """A tool could not do what was asked; the message goes to the model."""


def truncate(text: str, cap: int) -> str:
    """``text`` cut to about ``cap`` characters: head and tail, with a marker of what was cut."""
    if len(text) <= cap:
        return text
    marker_room = 64
    keep = max(0, cap - marker_room)
    head = keep // 2
    tail = keep - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - tail :]}"


def describe_error(exc: BaseException) -> str:
    """The text a model sees for a failed call."""
    if isinstance(exc, RemoteError):
        return f"error: {type(exc).__name__} (code {exc.code}): {exc.message}"
    if isinstance(exc, ToolFailed):
        return f"error: {exc}"
    return f"error: {type(exc).__name__}: {exc}"


def plain_text(data: bytes) -> str:
    """Bytes from the workspace as text for the model (undecodable bytes become U+FFFD)."""
    return data.decode("utf-8", "replace")


class HeadTail:
    """At most ``cap`` bytes of a stream: its first ``cap // 2`` and its last ``cap - cap // 2``.

    The same shape execd returns in collected mode, so :func:`format_run`
    reads either; ``dropped`` counts the bytes lost between head and tail.
    """

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        """Take the next bytes of the stream."""
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            # Trim in bulk: at most twice the tail is ever held.
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def value(self) -> tuple[bytes, int]:
        """The kept bytes (head then tail) and how many were dropped between them."""
        tail = bytes(self.tail[-self.tail_cap :]) if self.tail_cap else b""
        kept = bytes(self.head) + tail
        return kept, self.total - len(kept)


def format_service(info: services.ServiceInfo) -> str:
    """A service's state as one line for the model."""
    parts = [f"service {info.name}: {info.state}"]
    if info.pid is not None:
        parts.append(f"pid {info.pid}")
    if info.ready:
        parts.append("ready")
    if info.exit_code is not None:
        parts.append(f"exit code {info.exit_code}")
    if info.signal is not None:
        parts.append(f"killed by signal {info.signal}")
    if info.restarts:
        parts.append(f"{info.restarts} restarts")
    parts.append(f"log {info.log_path} ({info.log_size} bytes)")
    if info.error:
        parts.append(f"error: {info.error}")
    return ", ".join(parts)


def format_run(result: shell.RunResult, exec_cap: int | None = None) -> str:
    """A command's result as text: status line, then stdout and stderr when not empty.

    When execd dropped the middle of a stream (``exec_cap`` being the
    ``output_cap`` the command ran with), a marker stands where the bytes were
    and the status line gives the stream's full size.
    """
    if result.timed_out:
        status = f"timed out after {result.duration:.1f} s"
    elif result.idle_out:
        status = f"stopped after {result.duration:.1f} s without output"
    elif result.signal is not None:
        status = f"killed by signal {result.signal}"
    else:
        status = f"exit code {result.exit_code}"
    if result.limit_exceeded is not None:
        status += f"; stopped by its {result.limit_exceeded} limit"
    note = memory_note(result)
    if note is not None:
        status += f"; {note}"
    return _with_streams(status, result, exec_cap)


def memory_note(result: shell.RunResult, memory: int | None = None) -> str | None:
    """What to say of a command that failed under a memory limit execd enforces as an rlimit.

    Where execd has no memory cgroup, the limit is ``RLIMIT_AS``: an
    allocation past it merely fails, and the program decides what happens
    (Python raises MemoryError, C programs report "Cannot allocate memory" or
    crash), so ``limit_exceeded`` cannot name it. None when the command did
    not fail, ran into a limit execd could tell, or had no such limit.
    ``memory``: the limit in bytes, when the caller knows it.
    """
    failed = result.signal is not None or result.exit_code not in (0, None)
    rlimit = (result.limits or {}).get("memory") == "rlimit"
    if not failed or not rlimit or result.limit_exceeded is not None:
        return None
    size = f" of {_size(memory)}" if memory else ""
    return (
        f"the command ran under a memory limit{size} (an address-space rlimit: an allocation "
        "past it fails, as MemoryError, 'Cannot allocate memory' or a crash), which may be "
        "why it failed"
    )


def _size(count: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count} bytes"


def format_session_run(result: sessions.RunResult, exec_cap: int | None = None) -> str:
    """A persistent-session command's result: status, cwd afterwards, then its output."""
    if result.session_ended:
        how = f"signal {result.signal}" if result.signal is not None else f"{result.exit_code}"
        status = f"the session's shell ended ({how}); the next call opens a new one"
    elif result.timed_out:
        status = f"timed out after {result.duration:.1f} s and was interrupted"
    elif result.interrupted:
        status = f"interrupted (exit code {result.exit_code})"
    else:
        status = f"exit code {result.exit_code}"
    if result.limit_exceeded is not None:
        status += f"; stopped by its {result.limit_exceeded} limit"
    if result.cwd is not None:
        status += f"; cwd {result.cwd}"
    return _with_streams(status, result, exec_cap)


def _with_streams(
    status: str, result: shell.RunResult | sessions.RunResult, exec_cap: int | None
) -> str:
    parts = [status]
    for label, data, dropped in (
        ("stdout", result.stdout, result.stdout_dropped),
        ("stderr", result.stderr, result.stderr_dropped),
    ):
        if not data and not dropped:
            continue
        if dropped:
            parts[0] += f"; {label} was {len(data) + dropped} bytes"
            split = exec_cap // 2 if exec_cap is not None else len(data)
            body = (
                plain_text(data[:split])
                + f"\n[... {dropped} bytes of {label} dropped in the workspace ...]\n"
                + plain_text(data[split:])
            )
        else:
            body = plain_text(data)
        parts.append(f"{label}:\n{body}")
    return "\n".join(parts)
