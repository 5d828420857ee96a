"""Messages over one-way pipes under deadlines: a stalled writer times a read out (and the read
resumes where it was), a writer killed mid-message is an end of file, a reader that is gone
fails a write at once, a full pipe times a write out, and files are replaced atomically."""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import time

import pytest

from rlhf_lightning.runtime.channel import ChannelClosed, ChannelTimeout, Reader, Writer, write_atomic


def pipe() -> tuple[Reader, Writer]:
    r, w = os.pipe()
    return Reader(r), Writer(w)


def frame(obj) -> bytes:
    data = pickle.dumps(obj)
    return struct.pack(">Q", len(data)) + data


def test_a_round_trip_of_small_and_large_messages():
    reader, writer = pipe()
    writer.send(("hello", 1))
    assert reader.poll(0.0) and reader.recv(1.0) == ("hello", 1)
    assert not reader.poll(0.0)
    big = bytes(range(256)) * 4000  # 1 MB: far more than a pipe holds, read while it is written
    child = os.fork()
    if child == 0:  # pragma: no cover - the writing process
        reader.close()
        writer.send(big)
        os._exit(0)
    writer.close()
    assert reader.recv(10.0) == big
    os.waitpid(child, 0)
    with pytest.raises(ChannelClosed):
        reader.recv(1.0)  # the only writer is gone: an end of file


def test_a_stalled_writer_times_the_read_out_and_the_read_resumes():
    reader, writer = pipe()
    data = frame({"k": list(range(100))})
    os.write(writer.fd, data[:7])  # not even the whole header
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout):
        reader.recv(0.2)
    assert 0.15 < time.monotonic() - t0 < 2.0
    os.write(writer.fd, data[7:20])
    with pytest.raises(ChannelTimeout):
        reader.recv(0.05)
    os.write(writer.fd, data[20:])
    assert reader.recv(1.0) == {"k": list(range(100))}  # the bytes read before were kept


def test_a_writer_killed_in_the_middle_of_a_message_is_an_end_of_file_not_a_hang():
    r, w = os.pipe()
    big = frame(b"x" * (1 << 20))
    # A child that writes part of a big message, then stops for ever; killed, it never finishes.
    code = f"import os, sys, time; os.write({w}, sys.stdin.buffer.read()); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, pass_fds=(w,))
    os.close(w)
    reader = Reader(r)
    child.stdin.write(big[:30_000])  # type: ignore[union-attr]
    child.stdin.close()  # type: ignore[union-attr]
    with pytest.raises(ChannelTimeout):
        reader.recv(0.5)  # half a message: no whole one yet, and no blocking read() for the rest
    child.send_signal(signal.SIGKILL)
    child.wait()
    t0 = time.monotonic()
    with pytest.raises(ChannelClosed):
        reader.recv(30.0)
    assert time.monotonic() - t0 < 2.0  # at once, not at the deadline


def test_writing_to_a_reader_that_is_gone_or_does_not_read():
    reader, writer = pipe()
    reader.close()
    with pytest.raises(ChannelClosed):
        writer.send("anyone?", 1.0)
    reader, writer = pipe()
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout):
        writer.send_bytes(b"x" * (1 << 20), 0.3)  # nobody reads: the pipe stays full
    assert time.monotonic() - t0 < 2.0


def test_write_atomic_replaces_whole_files(tmp_path):
    path = tmp_path / "batch.pkl"
    write_atomic(path, b"first")
    write_atomic(path, b"second")
    assert path.read_bytes() == b"second" and [p.name for p in tmp_path.iterdir()] == ["batch.pkl"]
