"""The commands of the README, docs/*.md and CONTRIBUTING.md run as written. Those that fit CI's time run, in order
(the README's, then each page's), from a directory laid out like a checkout (a few steps instead of hundreds); every
other train.py command's config, overrides and world size load; every plan.py command plans; what needs a GPU, a
download or your own files is named below, and a command a page gains must be placed in one of these groups. Every
link between the pages leads to a page and heading that exist, and every file of the repository a page names exists
(docs/log.md, a dated record, names files as they were)."""

import re
import shlex
from pathlib import Path

import pytest
import torch

import train
from dsv3 import parallel
from dsv3.config import Config, load_config
from scripts import convert_hf, plan, plot

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CONTRIBUTING.md"]
# the commands that run here, with these arguments added to keep them short
RUN = {
    "python train.py --config configs/debug.toml": ["--train.steps=2", "--train.seq_len=32", "--train.val_batches=1"],
    "python train.py --config configs/debug.toml --train.lr=1e-3 --train.steps=50 --model.n_layers=2 --log.every=5 "
    "--checkpoint.dir=runs/debug-lr": ["--train.steps=2", "--train.seq_len=32", "--train.val_batches=1"],
    "python scripts/plot.py runs/debug": [],
    "python scripts/plot.py runs/debug runs/debug-lr --out runs/cmp": [],
    "python scripts/convert_hf.py --to-hf runs/debug/export hf_out": [],
    "python scripts/convert_hf.py --to-hf runs/debug/export hf_out_no_mtp --no-mtp": [],
}
# (how a command starts, why it does not run here); train.py and plan.py commands are checked whatever they are
ELSEWHERE = [
    ("pip install", "installs packages"),
    ("python -m pytest", "this test suite"),
    ("ruff check", "the linter, which .ci/run runs before this suite"),
    ("python scripts/prepare_data.py", "the data fixture builds the bundled corpus; the others read your files"),
    ("python scripts/train_tokenizer.py", "reads your corpus"),
    ("python scripts/convert_hf.py --to-dsv3", "reads a downloaded Hugging Face checkpoint"),
    ("python scripts/convert_hf.py --to-hf runs/v3-continued/",
     "a 671B run's export (tests/test_continue_pretraining.py runs the same commands on a tiny model)"),
    ("python scripts/bench.py", "a GPU benchmark: its config and overrides are checked"),
    ("python scripts/bench_fp8.py", "a GPU benchmark: its config and overrides are checked"),
    ("python scripts/bench_save.py", "a GPU measurement (tests/test_async_save.py runs it on a tiny model)"),
    ("python scripts/bench_prepare.py", "minutes of 16 cores (tests/test_prepare.py checks the same paths)"),
    ("torchrun --nproc_per_node=2 scripts/bench_exchange.py", "2 GPUs"),
    ("scripts/install_deepep.sh", "builds DeepEP against CUDA"),
    ("scripts/install_deepgemm.sh", "builds DeepGEMM against CUDA"),
    ("export", "sets a variable"),
]


def page_commands(page: Path) -> list[str]:
    """Every command of a page's bash blocks: continuations joined, comments dropped, `&&` chains split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                command = words[:words.index("&&")] if "&&" in words else words
                commands.append(shlex.join(command))
                words = words[len(command) + 1:]
    return commands


def all_commands() -> list[str]:
    """Every page's commands, the README's first."""
    return [command for page in PAGES for command in page_commands(page)]


def train_args(command: str) -> tuple[list[str], int] | None:
    """(train.py's arguments, world size) of a command that runs train.py, else None."""
    words = shlex.split(command)
    while words and (re.fullmatch(r"[A-Z_]+=\S*", words[0]) or words[0] == "timeout"):  # OMP_NUM_THREADS=1 timeout 60
        words = words[2:] if words[0] == "timeout" else words[1:]
    for script, world in (("train.py", 1), ("scripts/slurm/train.sbatch", 8)):
        if script in words:
            launch, args = words[:words.index(script)], words[words.index(script) + 1:]
            flags = dict(match.groups() for word in launch if (match := re.fullmatch(r"--(\w+)=(\d+)", word)))
            return args, world * int(flags.get("nproc_per_node", 1)) * int(flags.get("nodes", 1))
    return None


def config_of(args: list[str]) -> Config:
    """The config a command line loads: its --config file and its --section.key=value overrides."""
    path = args[args.index("--config") + 1] if "--config" in args else None
    overrides = [arg for arg in args if arg.startswith("--") and "." in arg.split("=")[0]]
    return load_config(str(ROOT / path) if path else None, overrides)


def bench_world(command: str) -> int | None:
    """The world size of a `torchrun --nproc_per_node=N scripts/bench.py` command, else None."""
    match = re.match(r"torchrun --nproc_per_node=(\d+) scripts/bench\.py ", command)
    return int(match.group(1)) if match else None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_command_is_run_or_checked_here_or_said_to_need_more(page):
    for command in page_commands(page):
        known = (command in RUN or train_args(command) or bench_world(command)
                 or command.startswith("python scripts/plan.py")
                 or any(command.startswith(prefix) for prefix, _ in ELSEWHERE))
        assert known, f"a command of {page.name} this test does not know: {command}"


def test_every_train_py_command_loads_its_config_at_its_world_size():
    checked = 0
    for command in all_commands():
        if (found := train_args(command)) is None:
            continue
        args, world = found
        cfg = config_of(args)
        parallel.check_ep(cfg.parallel.ep, world, cfg.model_config().n_routed_experts)
        if cfg.train.device == "cpu":  # everything train.py checks before building, short of the data
            train.check_setup(cfg, world, torch.device("cpu"))
        checked += 1
    assert checked >= 8


def test_every_plan_and_bench_command_plans_or_loads(capsys):
    for command in all_commands():
        words = shlex.split(command)
        if command.startswith("python scripts/plan.py"):
            plan.main(words[2:])
            assert "tokens/s per GPU" in capsys.readouterr().out, command
        elif command.startswith(("python scripts/bench.py", "python scripts/bench_fp8.py")):
            config_of(words[2:])
        elif world := bench_world(command):
            cfg = config_of(words[3:])
            parallel.check_ep(cfg.parallel.ep, world, cfg.model_config().n_routed_experts)


@pytest.mark.slow
def test_the_cpu_commands_run_as_written_in_order(data, tmp_path, monkeypatch):
    for name in ("configs", "data"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    ran = [command for command in all_commands() if command in RUN]
    assert sorted(set(ran)) == sorted(RUN)
    for command in dict.fromkeys(ran):  # a command shown twice (the quick start's) runs once
        args = shlex.split(command)[2:] + RUN[command]
        {"train.py": train.main, "scripts/plot.py": plot.main,
         "scripts/convert_hf.py": convert_hf.main}[shlex.split(command)[1]](args)
    assert {p.name for p in (tmp_path / "runs" / "cmp").iterdir()} >= {"loss.png", "expert_load_debug.png"}
    assert (tmp_path / "hf_out" / "config.json").is_file()


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_leads_to_a_page_and_heading_that_exist(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor:
            assert anchor in heading_anchors(linked), f"{page.name} links to {target}: no such heading"


@pytest.mark.parametrize("page", [page for page in PAGES if page.name != "log.md"], ids=lambda page: page.name)
def test_every_file_a_page_names_exists(page):
    named = re.findall(r"(?<![\w/.$-])((?:dsv3|scripts|configs|tests|docs)/[\w/.-]*[\w/])", page.read_text())
    missing = sorted({path for path in named if not (ROOT / path).exists()})
    assert not missing, f"{page.name} names files that do not exist: {missing}"
