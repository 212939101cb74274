"""The failure policy (dsv3/failures.py): every failure a user can cause or a machine can suffer ends with one line on
stderr, naming what happened, the last complete checkpoint and what to run next, and its documented exit code. The
errors are the real ones: a full tmpfs, a dead gloo peer, a real signal, a directory really removed."""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, on_full_disk, torchrun_vars

import train
from dsv3 import export, failures
from dsv3.config import UserError, run_main

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "stdlib"
TINY = ["--config", str(ROOT / "configs" / "debug.toml"), f"--data.path={DATA}", "--log.every=1", "--model.n_layers=2",
        "--train.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2", "--train.val_every=0",
        "--checkpoint.export=false"]


def run_until(run_dir: Path, monkeypatch: pytest.MonkeyPatch, at_step: int, action, *overrides: str) -> SystemExit:
    """train.main under run_main, `action()` run before step `at_step`; the SystemExit it ends with."""
    real_step = train.train_step

    def step_with_action(model, optimizer, batch, t, step, *args):
        if step == at_step:
            action()
        return real_step(model, optimizer, batch, t, step, *args)

    monkeypatch.setattr(train, "train_step", step_with_action)
    with pytest.raises(SystemExit) as ended:
        run_main(lambda: train.main([*TINY, f"--checkpoint.dir={run_dir}", *overrides]))
    monkeypatch.undo()
    return ended.value


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not re.match(r"^step \d+/", line)]
    assert len(lines) == 1, err
    return lines[0]


_FILL = """
def fill(disk):
    with open(os.path.join(disk, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:  # the disk is full
            pass
"""


def test_a_disk_that_fills_during_the_third_save_keeps_the_two_before_and_says_so_in_one_line(tmp_path):
    """The disk fills while the rotation still keeps step-1 and step-2: torch's writer fails with no errno, the
    half save is removed only after the free space was judged, and the line says the disk is full."""
    disk = tmp_path / "disk"
    code = f"""
import os, sys, torch
sys.path.insert(0, ".")
from dsv3 import checkpoint
from dsv3.config import run_main
{_FILL}
disk = {str(disk)!r}
def save(step):
    torch.manual_seed(step)
    model = torch.nn.Linear(256, 256)
    checkpoint.save(disk, step, model, torch.optim.AdamW(model.parameters()), {{"step": step}}, keep=2)
def main():
    save(1)
    save(2)
    real_rng_state = checkpoint._rng_state
    checkpoint._rng_state = lambda: (fill(disk), real_rng_state())[1]
    save(3)
run_main(main)
"""
    ended = on_full_disk(disk, 4096, code)
    assert ended.returncode == failures.MACHINE, ended.stderr
    assert one_line(ended.stderr) == (f"error: the disk is full at {disk / 'step-3.tmp'} (the half-written step-3.tmp "
                                      "was removed); free space, then run the same command again")


def test_a_full_disk_while_logging_metrics_names_the_last_checkpoint_and_the_resume(tmp_path):
    disk = tmp_path / "disk"
    code = f"""
import os, sys
sys.path.insert(0, "."); sys.path.insert(0, "tests")
import train
from dsv3.config import run_main
{_FILL}
real_step = train.train_step
def step(model, optimizer, batch, t, step, *args):
    if step == 11:  # after step-10 was saved; the logs cross a page of the tmpfs before step 20's save
        fill({str(disk)!r})
    return real_step(model, optimizer, batch, t, step, *args)
train.train_step = step
run_main(lambda: train.main({TINY!r} + ["--checkpoint.dir={disk}", "--train.steps=40", "--checkpoint.every=10",
                                        "--checkpoint.keep=1"]))
"""
    ended = on_full_disk(disk, 64 << 10, code)
    assert ended.returncode == failures.MACHINE, ended.stderr
    line = one_line(ended.stderr)
    assert re.fullmatch(rf"error: the disk is full at {disk}/(metrics|expert_load)\.jsonl; the last complete "
                        rf"checkpoint is {disk}/step-10; free space \(or choose another --checkpoint.dir\), then "
                        rf"continue: python train.py .* --resume", line), line


def test_a_full_disk_during_the_export_names_the_checkpoint_and_resume_writes_it(tmp_path):
    """As on the H200 whose two 17 GB checkpoints and the export filled 64 GiB, after all of the training."""
    disk = tmp_path / "disk"
    args = [*TINY, f"--checkpoint.dir={disk}", "--train.steps=2", "--checkpoint.every=2", "--checkpoint.export=true"]
    code = f"""
import os, sys
sys.path.insert(0, "."); sys.path.insert(0, "tests")
import train
from dsv3 import export
from dsv3.config import run_main
{_FILL}
class FillingWriter(export.dcp.HuggingFaceStorageWriter):
    def write_data(self, plan, planner):
        fill({str(disk)!r})
        return super().write_data(plan, planner)
export.dcp.HuggingFaceStorageWriter = FillingWriter
run_main(lambda: train.main({args!r}))
"""
    ended = on_full_disk(disk, 64 << 10, code)
    assert ended.returncode == failures.MACHINE, ended.stderr
    line = one_line(ended.stderr)
    assert re.fullmatch(rf"error: the disk is full at {disk}/export\.tmp \(the half-written export\.tmp was "
                        r"removed; the export is written again by --resume\); the last complete checkpoint is "
                        rf"{disk}/step-2; free space \(or choose another --checkpoint.dir\), then continue: python "
                        r"train.py .* --resume", line), line


def test_a_diverged_run_is_one_line_with_exit_code_4(data, tmp_path, monkeypatch, capsys):
    model_of = {}
    real_build = train.build_model
    monkeypatch.setattr(train, "build_model", lambda *a, **k: model_of.setdefault("model", real_build(*a, **k)))
    poison = lambda: model_of["model"][0].embed.weight.data.fill_(float("nan"))  # noqa: E731
    ended = run_until(tmp_path, monkeypatch, 3, poison, "--train.steps=4", "--checkpoint.every=1")
    assert ended.code == failures.DIVERGED
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: the run diverged: loss is nan at step 3; ") and "--resume from it" in line


def test_a_run_directory_that_vanishes_is_one_line_with_exit_code_3(data, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    ended = run_until(run_dir, monkeypatch, 3, lambda: shutil.rmtree(run_dir), "--train.steps=4",
                      "--checkpoint.every=2")
    assert ended.code == failures.MACHINE
    assert one_line(capsys.readouterr().err).startswith(f"error: checkpoint.dir={run_dir} vanished while the run "
                                                        "wrote it")


def test_sigterm_during_start_up_says_nothing_was_saved_and_how_to_start_again(data, tmp_path, monkeypatch, capsys):
    def build_model(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal stops the run before this")

    monkeypatch.setattr(train, "build_model", build_model)
    with pytest.raises(SystemExit) as ended:
        run_main(lambda: train.main([*TINY, f"--checkpoint.dir={tmp_path}"]))
    assert ended.value.code == 143
    assert re.fullmatch(r"stopped by SIGTERM; no checkpoint was written yet; start again: python train\.py .*"
                        rf"--checkpoint.dir={tmp_path}", one_line(capsys.readouterr().err))


def test_sigterm_during_the_export_names_the_checkpoint_and_resume_writes_the_export(data, tmp_path, monkeypatch,
                                                                                    capsys):
    class SignalledWriter(export.dcp.HuggingFaceStorageWriter):
        def write_data(self, plan, planner):
            os.kill(os.getpid(), signal.SIGTERM)
            return super().write_data(plan, planner)

    args = [*TINY, f"--checkpoint.dir={tmp_path}", "--train.steps=1", "--checkpoint.every=1",
            "--checkpoint.export=true"]
    monkeypatch.setattr(export.dcp, "HuggingFaceStorageWriter", SignalledWriter)
    with pytest.raises(SystemExit) as ended:
        run_main(lambda: train.main(args))
    monkeypatch.undo()
    assert ended.value.code == 143
    assert re.fullmatch(rf"stopped by SIGTERM; the last complete checkpoint is {tmp_path / 'step-1'}; continue: "
                        r"python train\.py .* --resume", one_line(capsys.readouterr().err))
    assert not (tmp_path / "export").exists()
    train.main([*args, "--resume"])
    assert (tmp_path / "export" / "config.json").is_file()


_PEER = """
import os, sys, time
sys.path.insert(0, ".")
from datetime import timedelta
import torch, torch.distributed as dist
from dsv3.config import run_main
def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if dist.get_rank() == 1:
        os._exit(9)  # as if killed
    time.sleep(1)
    for _ in range(3):
        dist.all_reduce(torch.ones(1))
run_main(main)
"""


def test_a_rank_that_dies_leaves_the_survivor_one_line_not_gloos_traceback():
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", _PEER], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **torchrun_vars(rank, 2, port)}) for rank in range(2)]
    survivor = ranks[0].communicate(timeout=120)[1]
    ranks[1].communicate(timeout=120)
    assert ranks[1].returncode == 9
    assert ranks[0].returncode == failures.PEER, survivor
    assert one_line(survivor) == ("rank 0: error: another rank died (its connection closed), this one stops; "
                                  "find why in that rank's own output")


def test_a_bug_in_dsv3_keeps_its_traceback():
    with pytest.raises(ZeroDivisionError):
        run_main(lambda: 1 / 0)
    with pytest.raises(KeyError):
        run_main(lambda: {}["missing"])


def test_a_user_error_is_one_line_with_exit_code_2(capsys):
    def main():
        raise UserError("train.lr must be positive: set --train.lr=3e-4")

    with pytest.raises(SystemExit) as ended:
        run_main(main)
    assert ended.value.code == failures.USER
    assert capsys.readouterr().err == "error: train.lr must be positive: set --train.lr=3e-4\n"


def test_a_batch_the_host_cannot_hold_is_refused_before_it_is_allocated(data, tmp_path, capsys):
    """The battery's --train.micro_batch=999999999 --train.global_batch=999999999 grew to 24 GB until the OOM
    killer ended it with no message."""
    with pytest.raises(SystemExit) as ended:
        run_main(lambda: train.main([*TINY, f"--checkpoint.dir={tmp_path}", "--train.micro_batch=999999999",
                                     "--train.global_batch=999999999"]))
    assert ended.value.code == failures.USER
    assert re.fullmatch(r"error: train.global_batch=999999999 and train.micro_batch=999999999 at seq_len 32 need at "
                        r"least [\d,.]+ GiB of host memory per rank .* are available: lower --train.micro_batch and "
                        r"--train.global_batch\n", capsys.readouterr().err)
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []
