"""Files and directories of ours (a run directory's lock, logs and step-N.tmp/, a dataset's shards) opened without
following symbolic links: a link planted where one of ours should be would have the run write into its target (a
`lock` linked to another file truncates it). A link there is refused in one line; the run directory itself may be a
link (a run kept on a bigger disk). No torch here: scripts/prepare_data.py uses it."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO

from dsv3.config import UserError


def _link_error(path: str | Path) -> UserError:
    return UserError(f"{path} is a symbolic link where dsv3 keeps a file or directory of its own, and writing would "
                     f"go to the link's target: remove the link ({os.readlink(path)!r})")


def refuse_link(path: str | Path) -> None:
    """A UserError when `path` is a symbolic link."""
    if os.path.islink(path):
        raise _link_error(path)


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW, 0o644)


def open_no_follow(path: str | Path, mode: str = "r", **kwargs) -> IO:
    """open(path, mode) that refuses a symbolic link at `path` (O_NOFOLLOW) instead of opening its target."""
    try:
        return open(path, mode, opener=_no_follow, **kwargs)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise _link_error(path) from None
        raise


def append_line(f: IO, line: str) -> None:
    """Write `line` and flush it; an OS error (a full disk) names the file, which a flush's error does not."""
    try:
        f.write(line)
        f.flush()
    except OSError as e:
        raise OSError(e.errno, e.strerror, f.name) from e
