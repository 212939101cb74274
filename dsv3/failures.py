"""How an entry point ends when something fails: one line on stderr that names what happened, what is safe (the
run's last complete checkpoint) and what to run next, and an exit code per kind of failure (`run`). A traceback is
left only for what none of these kinds covers: a bug in dsv3.

    2   bad input the user can fix (UserError: config, data, a damaged or foreign file, paths)
    3   the machine: a full, read-only or over-quota disk; a run directory that vanished
    4   the run diverged (the divergence guard's FloatingPointError)
    5   a peer process died (another rank's connection closed)
    130, 143   stopped by Ctrl-C / SIGTERM (128 + the signal's number)
    1   anything else: a bug, with its traceback

No torch here: scripts/prepare_data.py runs under the same policy without it."""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

USER, MACHINE, DIVERGED, PEER = 2, 3, 4, 5
_DISK_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EROFS: "the disk is read-only",
                errno.EDQUOT: "the disk quota is exceeded"}
_DISK_TEXT = {"No space left on device": errno.ENOSPC, "Read-only file system": errno.EROFS,
              "Disk quota exceeded": errno.EDQUOT}
# what gloo and NCCL say on the ranks that survive one that died
_PEER_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "remote process exited or there was a network error")
_STEP_DIR = re.compile(r"^step-(\d+)$")


class UserError(ValueError):
    """Bad input the user can fix (config, data, tokenizer, paths, hardware, a plan that cannot fit): train.py and
    the scripts report it as one line on stderr with exit code 2, no traceback. The message names the fix."""


class Stopped(BaseException):
    """A SIGTERM outside the training loop (start-up, the export, a script): raised by the handler `run` installs,
    a BaseException like KeyboardInterrupt so that no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Run:
    """What the one line needs from a training run: where its checkpoints are and the command that continues it."""

    run_dir: Path | None = None
    argv: list[str] = []


def watch_run(run_dir: str | Path, argv: list[str]) -> None:
    """From here a failure of train.py names `run_dir`'s last complete checkpoint and the command to run next."""
    _Run.run_dir, _Run.argv = Path(run_dir), list(argv)


def _last_checkpoint() -> Path | None:
    run_dir = _Run.run_dir
    if run_dir is None or not run_dir.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in run_dir.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()]
    return max(found)[1] if found else None


def _command(resume: bool) -> str:
    from dsv3.stop import resume_command  # imports torch: only once a run is watched
    command = resume_command(_Run.argv)
    return command if resume else command.removesuffix(" --resume")


def _safe_and_next(fix: str) -> str:
    """The line's end: for a watched run its last complete checkpoint (or none yet), FIX and the command to run
    next; for a script, FIX alone."""
    if _Run.run_dir is None:
        return f"; {fix}" if fix else ""
    last = _last_checkpoint()
    if last is None:
        return f"; no checkpoint was written yet; {fix + ', then ' if fix else ''}start again: {_command(False)}"
    return f"; the last complete checkpoint is {last}; {fix + ', then ' if fix else ''}continue: {_command(True)}"


def _chain(e: BaseException) -> list[BaseException]:
    seen = []
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _disk_errno(e: BaseException) -> int | None:
    """ENOSPC, EROFS or EDQUOT when `e` or what caused it is that OS error, or says so (torch's writers and DCP's
    rank-0 reports carry the text, not the errno)."""
    for link in _chain(e):
        if getattr(link, "errno", None) in _DISK_ERRNOS:
            return link.errno
        for text, number in _DISK_TEXT.items():
            if text in str(link):
                return number
    return None


def _notes(e: BaseException) -> str:
    return "".join(f" ({note})" for note in getattr(e, "__notes__", ()))


def describe(e: BaseException) -> tuple[int, str] | None:
    """(exit code, the one line) for a failure of the kinds above, None for a bug."""
    if isinstance(e, SystemExit):
        return None
    if isinstance(e, KeyboardInterrupt):
        return 130, f"interrupted (Ctrl-C){_notes(e)}{_safe_and_next('')}"
    if isinstance(e, Stopped):
        return 128 + e.signum, f"stopped by {e}{_notes(e)}{_safe_and_next('')}"
    if isinstance(e, UserError):
        return USER, f"error: {e}{_notes(e)}"
    if isinstance(e, FloatingPointError):  # its message names the checkpoint left and the fix
        return DIVERGED, f"error: the run diverged: {e}{_notes(e)}"
    number = _disk_errno(e) if isinstance(e, Exception) else None
    if number is not None:
        where = next((link.filename for link in _chain(e) if getattr(link, "filename", None)), None)
        what = _DISK_ERRNOS[number] + (f" at {where}" if where else "")
        detail = str(e) if where is None or str(where) not in str(e) else ""
        return MACHINE, (f"error: {what}{': ' + detail if detail else ''}{_notes(e)}"
                         + _safe_and_next("free space (or choose another --checkpoint.dir)" if _Run.run_dir
                                          else "free space, then run the same command again"))
    if isinstance(e, Exception) and _Run.run_dir is not None and not _Run.run_dir.is_dir():  # whatever it broke
        return MACHINE, (f"error: checkpoint.dir={_Run.run_dir} vanished while the run wrote it ({e}); nothing of "
                         f"it is left: restore it from a backup, or start again: {_command(False)}")
    if isinstance(e, Exception) and any(text in str(link) for link in _chain(e) for text in _PEER_TEXT):
        return PEER, ("error: another rank died (its connection closed), this one stops" + _notes(e)
                      + _safe_and_next("find why in that rank's own output"))
    return None


def _rank_prefix() -> str:
    return f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


_HANDLER_PID = os.getpid()


def _on_sigterm(signum: int, frame: object) -> None:
    if os.getpid() != _HANDLER_PID:  # a forked worker (prepare_data's pool) that its parent ends: end quietly
        os._exit(128 + signum)
    raise Stopped(signum)


def run(main: Callable[[], object]) -> None:
    """Run an entry point under this policy. A machine's failure or a dead peer is printed by each rank that meets
    it, named; the other kinds by rank 0 alone (every rank meets the same). A process group still up is torn down
    first (not after a peer died: the process leaves at once), so no rank waits on one that has left."""
    _Run.run_dir, _Run.argv = None, []
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        global _HANDLER_PID
        _HANDLER_PID = os.getpid()
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        main()
    except BaseException as e:
        described = describe(e)
        if described is None:
            raise
        code, line = described
        if code in (MACHINE, PEER):
            print(_rank_prefix() + line, file=sys.stderr, flush=True)
        elif os.environ.get("RANK", "0") == "0":
            print(line, file=sys.stderr, flush=True)
        dist = sys.modules.get("torch.distributed")  # imported by the entry point if it uses torch at all
        if code == PEER:  # the group cannot be torn down without the dead rank, and gloo's threads abort at exit
            sys.stdout.flush()
            os._exit(code)
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(code)
    finally:
        _Run.run_dir, _Run.argv = None, []
