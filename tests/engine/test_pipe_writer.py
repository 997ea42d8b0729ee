"""The engine server's command pipe: written from the event loop, read by a plain Connection."""

from __future__ import annotations

import asyncio
import os
import threading
from multiprocessing.connection import Connection

from cachet.engine.pipe_writer import PipeWriter


def _pipe() -> tuple[Connection, int]:
    read_fd, write_fd = os.pipe()
    return Connection(read_fd, writable=False), write_fd


def _read_all(reader: Connection) -> list[object]:
    received: list[object] = []
    while True:
        try:
            received.append(reader.recv())
        except EOFError:
            return received


async def test_messages_arrive_whole_and_in_order_as_connection_frames() -> None:
    reader, write_fd = _pipe()
    writer = PipeWriter(write_fd, asyncio.get_running_loop())
    messages = [(1, "start"), {"tokens": list(range(50))}, None]
    for message in messages:
        writer.send(message)
    assert writer.buffered_bytes == 0  # small messages go straight into the pipe
    writer.close()
    assert await asyncio.to_thread(_read_all, reader) == messages


async def test_a_full_pipe_never_blocks_the_sender_and_loses_nothing() -> None:
    reader, write_fd = _pipe()
    writer = PipeWriter(write_fd, asyncio.get_running_loop())
    # Far past a pipe's 64 KiB while nobody reads: a blocking write would hang the loop here.
    big = [bytes([index]) * 300_000 for index in range(4)]
    for message in big:
        writer.send(message)
    writer.send("after")
    assert writer.buffered_bytes > 0
    writer.close()  # once flushed: the reader still gets everything, then EOF
    assert await asyncio.wait_for(asyncio.to_thread(_read_all, reader), 30) == [*big, "after"]
    assert writer.buffered_bytes == 0


async def test_a_reader_that_went_away_makes_sending_a_no_op() -> None:
    reader, write_fd = _pipe()
    writer = PipeWriter(write_fd, asyncio.get_running_loop())
    reader.close()
    writer.send("nobody reads this")
    writer.send(b"x" * 200_000)
    assert writer.buffered_bytes == 0
    writer.close()


async def test_abandon_drops_what_a_stuck_reader_never_took() -> None:
    reader, write_fd = _pipe()
    writer = PipeWriter(write_fd, asyncio.get_running_loop())
    writer.send(b"y" * 300_000)
    assert writer.buffered_bytes > 0
    writer.close()  # cannot finish: nobody reads
    writer.abandon()
    assert writer.buffered_bytes == 0
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            reader.recv()
        except (EOFError, OSError) as error:
            outcome.append(error)

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(10)
    # What the pipe took is part of one frame; its reader gets an error, never half a message.
    assert not thread.is_alive() and len(outcome) == 1
