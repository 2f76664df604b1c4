"""Reading a non-blocking socket from Trio without its stream layer (shared by the HTTP/2 server,
the gateway's upstream connections and the HTTP/1.1 server).

Trio's socket reads go through an async context manager that raises and catches an exception
each time the socket is empty, the common case for a server between requests; these read first
and wait only when there is nothing.
"""
from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


async def read_when_ready(raw: socket.socket, read: Callable[[], T], turn: bool = True,
                          wait_first: bool = False) -> T:
    """``read()`` (a non-blocking read of ``raw``) now if the socket has data, else once it is
    readable. A read that did not wait then yields a turn of the run loop, as Trio's socket reads
    do (without ``turn``: it only checks for cancellation; the caller yields now and then). A read
    that had to wait does not yield a second turn. With ``wait_first`` (the caller's last read
    most likely emptied the socket) it waits before the first try instead of failing one."""
    if not wait_first:
        try:
            got = read()
        except BlockingIOError:
            pass
        else:
            if turn:
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.checkpoint_if_cancelled()
            return got
    while True:
        await trio.lowlevel.wait_readable(raw)
        try:
            return read()
        except BlockingIOError:
            pass
