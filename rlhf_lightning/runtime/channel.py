"""Messages between our own processes over one-way pipes, every read and write under a deadline.

A message is one frame: an 8-byte length, then the pickled object. Both ends work on
non-blocking file descriptors through ``select``, so

- a read never blocks past its deadline, even when the writer stalls in the middle of a large
  message (:class:`ChannelTimeout`; the bytes read so far are kept for the next call);
- a writer that dies, mid-message or not, is an end of file once no other process holds the
  pipe's write end (:class:`ChannelClosed`): each process closes the ends it does not use;
- a write to a reader that is gone fails at once (``EPIPE``: :class:`ChannelClosed`), and a
  write to a reader that does not read (a full pipe) gives up at its deadline.

Only our own processes are on either end (pickle runs code: never read a frame from anyone
else). Large payloads that must not hold up the writer travel as files (:func:`write_atomic`)
with a small message naming them.
"""

from __future__ import annotations

import errno
import os
import pickle
import select
import struct
import time
from pathlib import Path
from typing import Any

_HEADER = struct.Struct(">Q")
_CHUNK = 1 << 20
# The longest message that fits one atomic pipe write (POSIX PIPE_BUF is at least 512; Linux 4096).
ATOMIC_BYTES = 4096


class ChannelClosed(EOFError):
    """The process on the other end is gone (end of file, or a broken pipe)."""


class ChannelTimeout(TimeoutError):
    """The deadline passed before a whole message was read or written."""


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def deadline_in(timeout_s: float | None) -> float | None:
    """The ``time.monotonic()`` deadline ``timeout_s`` from now (None: no deadline)."""
    return None if timeout_s is None else time.monotonic() + timeout_s


class Reader:
    """The read end of a pipe (a file descriptor this object now owns)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._buf = bytearray()

    def _whole(self) -> bool:
        """Whether the buffer holds a whole frame."""
        if len(self._buf) < _HEADER.size:
            return False
        return len(self._buf) >= _HEADER.size + _HEADER.unpack_from(self._buf)[0]

    def _frame(self) -> bytes | None:
        """A whole frame from the buffer, or None."""
        if not self._whole():
            return None
        (n,) = _HEADER.unpack_from(self._buf)
        data = bytes(self._buf[_HEADER.size : _HEADER.size + n])
        del self._buf[: _HEADER.size + n]
        return data

    def recv_bytes(self, timeout_s: float | None = None) -> bytes:
        """The next message's bytes; :class:`ChannelTimeout` after ``timeout_s`` (None: wait as
        long as the writer lives), :class:`ChannelClosed` when the writer is gone."""
        deadline = deadline_in(timeout_s)
        while (frame := self._frame()) is None:
            ready, _, _ = select.select([self.fd], [], [], _remaining(deadline))
            if not ready:
                raise ChannelTimeout(f"no whole message within {timeout_s:g} s")
            try:
                chunk = os.read(self.fd, _CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                raise ChannelClosed("the writing process closed its end (it exited or was killed)")
            self._buf += chunk
        return frame

    def recv(self, timeout_s: float | None = None) -> Any:
        """The next message (see :meth:`recv_bytes`)."""
        return pickle.loads(self.recv_bytes(timeout_s))

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Whether a message (or the end of file) can be read now, waiting up to ``timeout_s``."""
        if self._whole():
            return True
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        return bool(ready)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Writer:
    """The write end of a pipe (a file descriptor this object now owns)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)

    def send_bytes(self, data: bytes, timeout_s: float | None = None) -> None:
        """Write one message; :class:`ChannelClosed` if the reader is gone, :class:`ChannelTimeout`
        if the pipe stays full past ``timeout_s`` (None: as long as the reader lives)."""
        view = memoryview(_HEADER.pack(len(data)) + data)
        deadline = deadline_in(timeout_s)
        while view:
            try:
                n = os.write(self.fd, view)
            except BlockingIOError:
                _, ready, _ = select.select([], [self.fd], [], _remaining(deadline))
                if not ready:
                    raise ChannelTimeout(f"the reader took no message within {timeout_s:g} s") from None
                continue
            except BrokenPipeError:
                raise ChannelClosed("the reading process closed its end (it exited or was killed)") from None
            except OSError as err:
                if err.errno == errno.EPIPE:
                    raise ChannelClosed("the reading process is gone") from None
                raise
            view = view[n:]

    def send(self, obj: Any, timeout_s: float | None = None) -> None:
        """Pickle ``obj`` and write it (see :meth:`send_bytes`)."""
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), timeout_s)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def take_fd(connection: Any) -> int:
    """The file descriptor of a ``multiprocessing`` connection (how a pipe end reaches a spawned
    process), duplicated for this module to own; the connection is closed."""
    fd = os.dup(connection.fileno())
    connection.close()
    return fd


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary file in the same directory and a rename: a
    reader sees the whole file or none (a writer killed mid-write leaves only ``.tmp-*``)."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
