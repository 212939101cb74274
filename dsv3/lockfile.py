"""An OS lock on a file that names its holder: what keeps two runs off one run directory (dsv3.rundir) or one
prepared dataset (scripts/prepare_data.py). No torch here: prepare_data.py and its workers do not import it."""

from __future__ import annotations

import fcntl
import os
import socket
from typing import IO


def take_lock(lock: IO) -> tuple[str, str] | None:
    """Take an OS lock on the open file `lock` (the OS drops it when the file closes or the process dies) and write
    this process's pid and host into it; or, when another process holds it, close the file and return that one's
    (pid, host)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().split() or ["?", "?"]
        lock.close()
        return holder[0], holder[-1]
    lock.truncate(0)
    lock.write(f"{os.getpid()} {socket.gethostname()}\n")
    lock.flush()
    return None
