"""Data mixtures: several prepared datasets mixed by weight, deterministic at every world size, resumable exactly,
each source re-epoching on its own; and train.py on a mixture (tokens and val loss per source, kill and resume)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_metrics

import train
from dsv3.config import UserError, load_config
from dsv3.data import MixtureLoader, PackedLoader
from scripts.prepare_data import prepare

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = str(ROOT / "data" / "tokenizer.model")
CONFIG = str(ROOT / "configs" / "debug.toml")
TINY = ["--model.n_layers=2", "--train.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2",
        "--checkpoint.export=false", "--log.every=1"]


def write_source(root: Path, name: str, docs: list[str]) -> Path:
    """`docs` as .txt files, prepared into root/name with the bundled tokenizer."""
    text = root / f"{name}-txt"
    text.mkdir(parents=True)
    for i, doc in enumerate(docs):
        (text / f"{i:04d}.txt").write_text(doc)
    prepare([str(text)], TOKENIZER, str(root / name), val_fraction=0.1, progress=False)
    return root / name


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Three datasets of different sizes: prose (the largest), code, and a tiny one of numbers."""
    root = tmp_path_factory.mktemp("sources")
    prose = [" ".join(f"the {w} of {i} walks by the river" for w in ("dog", "cat", "owl")) * (5 + i % 4)
             for i in range(60)]
    code = [f"def f{i}(x):\n    return [x * {{j}} for j in range({i})]\n" * (3 + i % 5) for i in range(40)]
    numbers = [" ".join(str(i * j) for j in range(40)) for i in range(20)]
    return {name: write_source(root, name, docs)
            for name, docs in (("prose", prose), ("code", code), ("numbers", numbers))}


def mixture(sources: dict[str, Path], **weights: float) -> list[tuple[str, str, float]]:
    total = sum(weights.values())
    return [(name, str(sources[name]), weight / total) for name, weight in weights.items()]


def test_one_source_reads_exactly_as_its_packed_loader(sources):
    alone = PackedLoader(str(sources["prose"]), "train", 16, seed=7)
    mixed = MixtureLoader(mixture(sources, prose=1), "train", 16, seed=7)
    for _ in range(2 * alone.num_sequences // 6 + 1):
        assert torch.equal(mixed.next_batch(6), alone.next_batch(6))


def test_every_prefix_of_the_order_gives_each_source_its_share():
    shares = [0.5, 0.3, 0.15, 0.05]
    loader = MixtureLoader.__new__(MixtureLoader)  # the source order needs no data
    loader.upper = np.array([int(c * 2.0**64) for c in np.cumsum(shares)[:-1]], dtype=np.uint64)
    source = loader.source_of(np.arange(100_000))
    for n in (20, 100, 1000, 100_000):
        counts = np.bincount(source[:n], minlength=4)
        assert np.all(np.abs(counts - n * np.array(shares)) <= 3), (n, counts)
    # a place far into a long run costs nothing more, and still draws every source
    assert set(loader.source_of(np.arange(10**12, 10**12 + 200)).tolist()) == {0, 1, 2, 3}


def test_a_small_source_re_epochs_on_its_own(sources):
    loader = MixtureLoader(mixture(sources, prose=1, numbers=1), "train", 16, seed=0)
    prose, numbers = loader.loaders["prose"], loader.loaders["numbers"]
    assert numbers.num_sequences < prose.num_sequences // 2
    for _ in range(numbers.num_sequences):
        loader.next_batch(2)  # about numbers.num_sequences of each
    tokens = loader.tokens_seen()
    assert tokens["numbers"] + tokens["prose"] == 2 * numbers.num_sequences * 16
    assert abs(tokens["numbers"] - tokens["prose"]) <= 2 * 16
    assert prose.sequences_consumed < prose.num_sequences  # prose is still in its first epoch
    # numbers' first epoch was a permutation of all its sequences, and its second has begun
    in_order = PackedLoader(str(sources["numbers"]), "train", 16, shuffle=False)
    first_epoch = numbers.rows(np.arange(numbers.num_sequences))
    assert sorted(map(tuple, first_epoch.tolist())) == sorted(map(tuple, in_order.rows(
        np.arange(numbers.num_sequences)).tolist()))


def test_rank_slices_concatenate_to_the_single_process_batch_and_resume_resharded(sources):
    weights = mixture(sources, prose=0.6, code=0.3, numbers=0.1)
    single = MixtureLoader(weights, "train", 16, seed=1)
    four = [MixtureLoader(weights, "train", 16, rank=r, world_size=4, seed=1) for r in range(4)]
    for _ in range(5):
        batch = single.next_batch(8)
        torch.testing.assert_close(torch.cat([loader.next_batch(8) for loader in four]), batch)
    two = [MixtureLoader(weights, "train", 16, rank=r, world_size=2, seed=99) for r in range(2)]
    for loader in two:  # the saved state carries the seed, every source's position and the mixture's
        loader.load_state_dict(four[3].state_dict())
    for _ in range(40):
        torch.testing.assert_close(torch.cat([loader.next_batch(8) for loader in two]), single.next_batch(8))


def test_resuming_with_other_sources_is_refused(sources):
    state = MixtureLoader(mixture(sources, prose=1, code=1), "train", 16).state_dict()
    with pytest.raises(UserError, match="resume with the same data.sources"):
        MixtureLoader(mixture(sources, prose=1, numbers=1), "train", 16).load_state_dict(state)


def test_sources_parse_from_the_command_line_and_toml(tmp_path):
    expected = [("web", "data/web", 0.7), ("code", "data/code", 0.3)]
    assert load_config(None, ["--data.sources=data/web:0.7,data/code:0.3"]).data.mixture() == expected
    toml = tmp_path / "mix.toml"
    toml.write_text('[data]\nsources = ["data/web:7", "data/code:3"]\n')
    assert load_config(str(toml)).data.mixture() == expected
    assert load_config(None, ["--data.path=corpus/v2"]).data.mixture() == [("v2", "corpus/v2", 1.0)]


@pytest.mark.parametrize("override, error", [
    ("--data.sources=data/web:0", "is not DIR:WEIGHT with a weight > 0"),
    ("--data.sources=data/web:-1,data/code:1", "is not DIR:WEIGHT with a weight > 0"),
    ("--data.sources=data/web", "is not DIR:WEIGHT"),
    ("--data.sources=data/web:1,data/web:2", "names a directory twice"),
])
def test_bad_sources_are_one_clear_error(override, error):
    with pytest.raises(UserError, match=error):
        load_config(None, [override])


def run(run_dir: Path, sources: dict[str, Path], *overrides: str, weights: str = "prose:0.7,code:0.3"):
    spec = ",".join(f"{sources[name]}:{w}" for name, w in (item.split(":") for item in weights.split(",")))
    train.main(["--config", CONFIG, f"--data.sources={spec}", f"--checkpoint.dir={run_dir}", *TINY, *overrides])
    return read_metrics(run_dir)


@pytest.mark.slow
def test_training_on_a_mixture_logs_tokens_and_val_loss_per_source(sources, tmp_path, capsys):
    metrics = run(tmp_path / "run", sources, "--train.steps=4", "--train.val_every=4", "--train.val_batches=1")
    banner = capsys.readouterr().out
    assert "data    prose 70% (" in banner and "; code 30% (" in banner
    assert metrics[4]["tokens_seen/prose"] + metrics[4]["tokens_seen/code"] == 4 * 4 * 32
    assert metrics[4]["tokens_seen/prose"] > metrics[4]["tokens_seen/code"] > 0
    val = metrics[4]
    assert val["val_loss"] == pytest.approx(0.7 * val["val_loss/prose"] + 0.3 * val["val_loss/code"])
    assert val["val_loss/prose"] != val["val_loss/code"]


@pytest.mark.slow
def test_a_killed_mixture_run_resumes_exactly(sources, tmp_path, monkeypatch):
    args = ["--train.steps=6", "--train.val_every=3", "--train.val_batches=1", "--checkpoint.every=3"]
    weights = "prose:0.5,code:0.3,numbers:0.2"
    straight = run(tmp_path / "straight", sources, *args, weights=weights)

    real_step = train.train_step

    def killed_at_step_5(model, optimizer, batch, t, step, *rest):
        if step == 5:
            raise KeyboardInterrupt
        return real_step(model, optimizer, batch, t, step, *rest)

    monkeypatch.setattr(train, "train_step", killed_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed", sources, *args, weights=weights)
    monkeypatch.undo()
    resumed = run(tmp_path / "resumed", sources, *args, "--resume", weights=weights)
    for step in range(1, 7):
        for key, value in straight[step].items():
            if not key.startswith("tokens_per_s") and key not in ("time", "elapsed_s"):
                assert resumed[step][key] == value, (step, key)


def test_missing_source_or_mismatched_tokenizers_stop_before_the_model_is_built(sources, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(UserError, match="no token shards at .*nowhere"):
        train.main(["--config", CONFIG, f"--data.sources={sources['prose']}:1,{tmp_path / 'nowhere'}:1",
                    f"--checkpoint.dir={tmp_path / 'a'}", *TINY])
    # a copy of code whose index says another tokenizer made it
    other = tmp_path / "other"
    for split in ("train", "val"):
        (other / split).mkdir(parents=True)
        for file in (sources["code"] / split).iterdir():
            (other / split / file.name).write_bytes(file.read_bytes())
        index = json.loads((other / split / "index.json").read_text())
        index["tokenizer_fingerprint"] = "0" * 64
        (other / split / "index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="prepared with different tokenizers"):
        train.main(["--config", CONFIG, f"--data.sources={sources['prose']}:1,{other}:1",
                    f"--checkpoint.dir={tmp_path / 'b'}", *TINY])
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").glob("step-*"))


def test_data_tokenized_unlike_the_init_from_weights_is_refused_before_the_build(sources, deepseek_tokenizer_dir,
                                                                                  tmp_path, monkeypatch):
    weights = tmp_path / "weights"  # what convert_hf.py --to-dsv3 leaves beside the shards: the release's tokenizer
    weights.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights / name).write_bytes((deepseek_tokenizer_dir / name).read_bytes())
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(UserError, match=rf"prose was prepared with another tokenizer than the one "
                                        rf"checkpoint.init_from={weights} carries: re-run scripts/prepare_data.py "
                                        rf"--tokenizer {weights}$"):
        train.main(["--config", CONFIG, f"--data.path={sources['prose']}", f"--checkpoint.init_from={weights}",
                    f"--checkpoint.dir={tmp_path / 'run'}", *TINY])
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_resuming_with_other_data_is_refused_before_the_model_is_built(sources, tmp_path, monkeypatch):
    """The checkpoint restores only the keys this run's state has: a dropped source must not pass unnoticed; it and
    another seq_len are caught from the saved data state alone, before a model is built and loaded."""
    args = ["--train.steps=2", "--checkpoint.every=2", "--train.val_every=0"]
    run(tmp_path / "run", sources, *args, weights="prose:0.5,code:0.5")
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("built a model"))
    resume = ["--train.steps=4", "--checkpoint.every=2", "--train.val_every=0", "--resume"]
    with pytest.raises(UserError, match=r"the checkpoint read the data sources \{.*'code'.*\}, this run has "
                                        r"\{'prose'.*resume with the same data\.path or data\.sources"):
        run(tmp_path / "run", sources, *resume, weights="prose:1")
    with pytest.raises(UserError, match=r"saved with train\.seq_len=32, this run has 16"):
        run(tmp_path / "run", sources, *resume, "--train.seq_len=16", weights="prose:0.5,code:0.5")
