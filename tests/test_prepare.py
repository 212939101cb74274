"""scripts/prepare_data.py at scale: compressed inputs, worker processes, resumable staging, small corpora."""

import fcntl
import gzip
import hashlib
import json
import multiprocessing.pool
import re
import subprocess
import sys
import sysconfig
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import scripts.prepare_data as prepare_data
from dsv3.config import UserError
from dsv3.corpus import FEED_BYTES, STDLIB_MAX_CHARS, ReadOptions, expand_inputs, plan_units, read_unit, stdlib_units
from dsv3.tokenizer import Tokenizer, find_tokenizer
from scripts.prepare_data import prepare

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "data" / "tokenizer.model")
DOCS = [f"def f{i}(x):\n    return x * {i}  # café ✓ 数据 {i}\n" + "word " * (i % 7) for i in range(60)]
TOKENIZE_UNIT = prepare_data.tokenize_unit


def jsonl_bytes(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode()


def gzip_members(data: bytes) -> bytes:
    """Two gzip members, as `cat a.gz b.gz` makes: a reader must go on after the first."""
    return gzip.compress(data[: len(data) // 2]) + gzip.compress(data[len(data) // 2 :])


def zstd_frames(data: bytes) -> bytes:
    """Two zstd frames with content checksums (the zstd CLI's default)."""
    compressor = zstandard.ZstdCompressor(write_checksum=True)
    return compressor.compress(data[: len(data) // 2]) + compressor.compress(data[len(data) // 2 :])


def mixed_corpus(root: Path) -> Path:
    """A plain .jsonl several chunks long, a .jsonl.zst, .txt and .txt.gz files and a parquet of 4 row groups."""
    root.mkdir()
    (root / "a.jsonl").write_bytes(jsonl_bytes(DOCS))
    (root / "b.jsonl.zst").write_bytes(zstd_frames(jsonl_bytes(DOCS[:20])))
    for i, doc in enumerate(DOCS[:5]):
        (root / f"c{i}.txt").write_text(doc, encoding="utf-8")
    (root / "d.txt.gz").write_bytes(gzip_members("".join(DOCS[5:9]).encode()))
    pq.write_table(pa.table({"text": DOCS[:40]}), root / "e.parquet", row_group_size=10)
    return root


def dataset_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def read_split(split_dir: Path) -> np.ndarray:
    index = json.loads((split_dir / "index.json").read_text())
    return np.concatenate([np.fromfile(split_dir / s["file"], dtype=index["dtype"]) for s in index["shards"]])


def encoded(docs: list[str], tokenizer: Tokenizer) -> np.ndarray:
    """The token stream the corpus should give: each document as [BOS if add_bos] ids EOS."""
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    return np.array([t for d in docs for t in bos + tokenizer.encode(d) + [tokenizer.eos_id]])


def count_tokenized_units(monkeypatch: pytest.MonkeyPatch, fail_after: int | None = None) -> list:
    """Record the units this process tokenizes from now on; raise after `fail_after` of them, as a killed run."""
    done = []

    def tokenize_unit(unit, *args):
        if fail_after is not None and len(done) == fail_after:
            raise KeyboardInterrupt("killed")
        done.append(unit)
        return TOKENIZE_UNIT(unit, *args)

    monkeypatch.setattr(prepare_data, "tokenize_unit", tokenize_unit)
    return done


def test_gzip_padded_with_nuls_after_its_members_reads_as_pythons_gzip_does_but_not_before_the_first(tmp_path):
    plain = jsonl_bytes(DOCS)
    half = len(plain) // 2
    padding = b"\0" * (FEED_BYTES + 100)  # across a read of the compressed stream
    (tmp_path / "docs.jsonl.gz").write_bytes(gzip.compress(plain[:half]) + padding + gzip.compress(plain[half:])
                                             + padding)
    assert gzip.decompress((tmp_path / "docs.jsonl.gz").read_bytes()) == plain
    prepare([str(tmp_path / "docs.jsonl.gz")], TOKENIZER, str(tmp_path / "out"), val_fraction=0, progress=False)
    np.testing.assert_array_equal(read_split(tmp_path / "out" / "train"), encoded(DOCS, Tokenizer(TOKENIZER)))
    (tmp_path / "docs.jsonl.gz").write_bytes(padding)  # a download preallocated, never written: not an empty file
    with pytest.raises(UserError, match="corrupt gzip data"):
        prepare([str(tmp_path / "docs.jsonl.gz")], TOKENIZER, str(tmp_path / "out2"), val_fraction=0, progress=False)


@pytest.mark.parametrize("fmt", ["jsonl", "txt"])
def test_gz_and_zst_inputs_give_the_same_tokens_as_plain_files(tmp_path, fmt):
    plain = jsonl_bytes(DOCS) if fmt == "jsonl" else "".join(DOCS).encode()
    streams = {}
    for suffix, data in {"": plain, ".gz": gzip_members(plain), ".zst": zstd_frames(plain)}.items():
        corpus = tmp_path / f"docs.{fmt}{suffix}"
        corpus.write_bytes(data)
        prepare([str(corpus)], TOKENIZER, str(tmp_path / f"out{suffix}"), val_fraction=0, progress=False)
        streams[suffix] = read_split(tmp_path / f"out{suffix}" / "train")
    documents = DOCS if fmt == "jsonl" else ["".join(DOCS)]
    np.testing.assert_array_equal(streams[""], encoded(documents, Tokenizer(TOKENIZER)))
    np.testing.assert_array_equal(streams[".gz"], streams[""])
    np.testing.assert_array_equal(streams[".zst"], streams[""])


@pytest.mark.parametrize("chunk_bytes", [1, 37, 200, 1 << 20])
def test_jsonl_chunks_hold_every_line_exactly_once(tmp_path, chunk_bytes):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl_bytes(DOCS))
    units = plan_units([path], chunk_bytes, ReadOptions())
    assert len(units) == -(-path.stat().st_size // chunk_bytes)
    assert [doc for unit in units for doc in read_unit(unit, ReadOptions())] == DOCS


def test_any_worker_count_writes_byte_identical_datasets(tmp_path, monkeypatch):
    """1, 2 or 3 workers write byte-identical datasets, and a finished run's workers exit on their own, none left
    behind (a run that terminated its pool once hung after its last unit)."""
    corpus = mixed_corpus(tmp_path / "corpus")
    options = ReadOptions()
    units = prepare_data.corpus_units([str(corpus)], 800, options)
    assert sum(u.path.endswith("a.jsonl") for u in units) > 3 and sum(u.kind == "parquet" for u in units) > 1
    terminated = []
    monkeypatch.setattr(multiprocessing.pool.Pool, "terminate", lambda pool: terminated.append(pool))
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"out{workers}"
        prepare([str(corpus)], TOKENIZER, str(out), val_fraction=0.05, shard_tokens=500, workers=workers,
                chunk_bytes=800, progress=False)
        outputs.append(dataset_files(out))
        assert not terminated and not multiprocessing.active_children()
    assert outputs[0] == outputs[1] == outputs[2]
    assert len([name for name in outputs[0] if name.startswith("train/shard_")]) > 3
    # the documents in corpus order, val the 2nd and every 20th: nothing lost or repeated at chunk edges
    tokenizer = Tokenizer(TOKENIZER)
    docs = [doc for unit in units for doc in read_unit(unit, options)]
    val = [i % 20 == 1 for i in range(len(docs))]
    np.testing.assert_array_equal(read_split(tmp_path / "out1" / "train"),
                                  encoded([d for d, v in zip(docs, val) if not v], tokenizer))
    np.testing.assert_array_equal(read_split(tmp_path / "out1" / "val"),
                                  encoded([d for d, v in zip(docs, val) if v], tokenizer))


def test_killed_run_reruns_only_the_unfinished_units_and_ends_identical(tmp_path, monkeypatch):
    corpus = mixed_corpus(tmp_path / "corpus")
    settings = dict(tokenizer_path=TOKENIZER, chunk_bytes=800, progress=False)
    prepare([str(corpus)], out_dir=str(tmp_path / "uninterrupted"), **settings)
    total = len(prepare_data.corpus_units([str(corpus)], 800, ReadOptions()))
    out = tmp_path / "out"
    count_tokenized_units(monkeypatch, fail_after=4)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], out_dir=str(out), **settings)
    assert not out.exists() and len(list((tmp_path / "out.partial" / "units").glob("*.docs"))) == 4
    rerun = count_tokenized_units(monkeypatch)
    prepare([str(corpus)], out_dir=str(out), **settings)
    assert len(rerun) == total - 4
    assert dataset_files(out) == dataset_files(tmp_path / "uninterrupted")
    assert not (tmp_path / "out.partial").exists()


def test_a_kill_while_the_staging_directory_is_removed_does_not_block_the_next_run(tmp_path, monkeypatch):
    corpus = mixed_corpus(tmp_path / "corpus")
    settings = dict(tokenizer_path=TOKENIZER, chunk_bytes=800, progress=False)
    real_rmtree = prepare_data.shutil.rmtree

    def killed_after_the_manifest(path, *args, **kwargs):  # rmtree's order is the directory's, not ours
        if (Path(path) / "manifest.json").exists():
            (Path(path) / "manifest.json").unlink()
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(prepare_data.shutil, "rmtree", killed_after_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], out_dir=str(tmp_path / "out"), **settings)
    monkeypatch.undo()
    prepare([str(corpus)], out_dir=str(tmp_path / "out"), **settings)  # no "not a staging directory" refusal
    assert dataset_files(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out", "out.lock"]


@pytest.mark.slow
def test_sigkilled_workers_leave_units_a_rerun_finishes_identically(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(DOCS[:12]):
        (corpus / f"doc_{i:02d}.txt").write_text(doc * 50)
    prepare([str(corpus)], TOKENIZER, str(tmp_path / "uninterrupted"), progress=False)
    out = tmp_path / "out"
    kill_at_unit_9 = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
import scripts.prepare_data as p
real = p.tokenize_unit
def tokenize_unit(unit, *args):
    if unit.path.endswith("doc_09.txt"):
        os.killpg(0, signal.SIGKILL)  # the whole job, as kill -9 or an OOM kill of the group would
    return real(unit, *args)
p.tokenize_unit = tokenize_unit
p.prepare([{str(corpus)!r}], {TOKENIZER!r}, {str(out)!r}, workers=2, progress=False)
"""
    killed = subprocess.run([sys.executable, "-c", kill_at_unit_9], start_new_session=True, capture_output=True)
    assert killed.returncode == -9 and not out.exists()
    finished = len(list((tmp_path / "out.partial" / "units").glob("*.docs")))
    assert 0 < finished < 12
    rerun = count_tokenized_units(monkeypatch)
    prepare([str(corpus)], TOKENIZER, str(out), progress=False)
    assert len(rerun) == 12 - finished
    assert dataset_files(out) == dataset_files(tmp_path / "uninterrupted")


def test_other_settings_restart_the_staging_and_a_changed_file_redoes_only_its_units(tmp_path, monkeypatch, capsys):
    corpus = mixed_corpus(tmp_path / "corpus")
    units = prepare_data.corpus_units([str(corpus)], 800, ReadOptions())
    finished = [u.path for u in units].index(str(corpus / "c2.txt"))  # units before c2.txt, c1.txt among them
    settings = dict(tokenizer_path=TOKENIZER, out_dir=str(tmp_path / "out"), chunk_bytes=800, progress=False)
    count_tokenized_units(monkeypatch, fail_after=finished)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], **settings)
    rerun = count_tokenized_units(monkeypatch, fail_after=finished)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], dtype="uint32", **settings)
    assert "starting it afresh" in capsys.readouterr().err
    assert len(rerun) == finished
    (corpus / "c1.txt").write_text("a changed document\n")
    rerun = count_tokenized_units(monkeypatch)
    prepare([str(corpus)], dtype="uint32", **settings)
    assert f"{finished - 1} of {len(units)} units are already tokenized" in capsys.readouterr().err
    assert [u.path for u in rerun] == [str(corpus / "c1.txt")] + [u.path for u in units[finished:]]


@pytest.mark.parametrize("name, damage, where", [
    ("docs.jsonl.gz", "flip", r"corrupt gzip data in compressed bytes \d+-\d+ \("),
    ("docs.jsonl.gz", "truncate", r"gzip data ends mid-stream at compressed byte \d+"),
    ("docs.txt.zst", "flip", r"corrupt zstd data in compressed bytes \d+-\d+ \("),
    ("docs.jsonl.zst", "truncate", r"zstd data ends mid-stream at compressed byte \d+"),
])
def test_corrupt_compressed_file_names_file_and_offset_and_leaves_out_untouched(tmp_path, name, damage, where):
    out = tmp_path / "out"
    prepare([str(mixed_corpus(tmp_path / "corpus"))], TOKENIZER, str(out), progress=False)
    before = dataset_files(out)
    plain = jsonl_bytes(DOCS * 40)
    data = bytearray(gzip_members(plain) if name.endswith(".gz") else zstd_frames(plain))
    if damage == "flip":
        data[len(data) // 3] ^= 0x5A
    else:
        del data[len(data) * 3 // 4 :]
    (tmp_path / name).write_bytes(data)
    with pytest.raises(UserError, match=rf"{name}: {where}"):  # the first failing unit of several
        prepare([str(tmp_path / name), str(tmp_path / "corpus")], TOKENIZER, str(out), workers=2, progress=False)
    assert dataset_files(out) == before


def test_lines_garbled_by_a_corrupt_stream_are_reported_as_the_corruption(tmp_path):
    data = bytearray(gzip.compress(jsonl_bytes([f"x = {i}" for i in range(200)]) * 50, mtime=0))
    data[len(data) // 2] ^= 0x5A  # decodes on for a while, as garbage: a bad JSON line before the CRC check
    (tmp_path / "docs.jsonl.gz").write_bytes(data)
    with pytest.raises(UserError, match=r"docs\.jsonl\.gz: gzip data ends mid-stream at compressed byte \d+"):
        prepare([str(tmp_path / "docs.jsonl.gz")], TOKENIZER, str(tmp_path / "out"), progress=False)


def test_bad_jsonl_line_in_a_compressed_file_or_a_later_chunk_names_its_line(tmp_path):
    lines = jsonl_bytes(DOCS).splitlines(keepends=True)
    lines[44] = b'{"text": "cut off\n'
    (tmp_path / "docs.jsonl.zst").write_bytes(zstd_frames(b"".join(lines)))
    with pytest.raises(UserError, match=r"docs\.jsonl\.zst:45: not valid JSON"):
        prepare([str(tmp_path / "docs.jsonl.zst")], TOKENIZER, str(tmp_path / "out"), progress=False)
    (tmp_path / "docs.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(UserError, match=r"docs\.jsonl:45: not valid JSON"):
        prepare([str(tmp_path / "docs.jsonl")], TOKENIZER, str(tmp_path / "out"), chunk_bytes=300, progress=False)


def test_compressed_jsonl_is_read_as_a_stream(tmp_path):
    docs = [hashlib.sha256(str(i).encode()).hexdigest() + DOCS[i % len(DOCS)] for i in range(30_000)]
    path = tmp_path / "big.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(docs)))  # 4 MB of text
    (unit,) = plan_units([path], 1 << 20, ReadOptions())
    tracemalloc.start()
    n_docs = sum(1 for _ in read_unit(unit, ReadOptions()))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n_docs == len(docs) and peak < 1 << 20


def test_index_records_the_tokenizer_and_the_dataset_carries_it(tmp_path, deepseek_tokenizer_dir):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_bytes(jsonl_bytes(DOCS))
    for name, path in {"sp": TOKENIZER, "hf": str(deepseek_tokenizer_dir)}.items():
        out = tmp_path / name
        prepare([str(corpus)], path, str(out), val_fraction=0, workers=2, progress=False)
        tokenizer = Tokenizer(path)
        index = json.loads((out / "train" / "index.json").read_text())
        assert index["tokenizer_fingerprint"] == tokenizer.fingerprint == find_tokenizer(out / "tokenizer").fingerprint
        assert index["add_bos"] is tokenizer.add_bos is (name == "hf")
        np.testing.assert_array_equal(read_split(out / "train"), encoded(DOCS, tokenizer))  # BOS first if add_bos


def test_a_few_documents_give_val_the_asked_fraction_of_tokens(tmp_path, capsys):
    corpus = tmp_path / "three.jsonl"
    corpus.write_bytes(jsonl_bytes(DOCS[:3]))
    indexes = prepare([str(corpus)], TOKENIZER, str(tmp_path / "out"), val_fraction=0.1, progress=False)
    total = indexes["train"]["num_tokens"] + indexes["val"]["num_tokens"]
    assert indexes["val"]["num_tokens"] == round(0.1 * total)  # not the 2nd document: a third of the tokens
    assert re.search(r"whole documents would put 3\d\.\d% of the tokens in val", capsys.readouterr().err)


def test_val_shorter_than_a_default_sequence_is_warned_about_at_prepare_time(tmp_path, capsys):
    corpus = tmp_path / "short.jsonl"
    corpus.write_bytes(jsonl_bytes([f"x = {i}\n" for i in range(200)]))
    indexes = prepare([str(corpus)], TOKENIZER, str(tmp_path / "out"), progress=False)
    assert indexes["val"]["num_documents"] == 2 and indexes["val"]["num_tokens"] < 257
    warning = f"warning: val is {indexes['val']['num_tokens']} tokens, fewer than the 257 (seq_len + 1)"
    assert warning in capsys.readouterr().err
    prepare([str(corpus)], TOKENIZER, str(tmp_path / "out"), val_fraction=0.5, progress=False)
    assert "warning" not in capsys.readouterr().err


@pytest.mark.slow
def test_an_input_error_prints_on_its_own_line_after_the_progress_bar(tmp_path):
    (tmp_path / "docs.jsonl").write_bytes(jsonl_bytes(DOCS) + b"not json\n")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--input", str(tmp_path / "docs.jsonl"),
         "--out", str(tmp_path / "out"), "--workers", "1"], capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "tokenizing" in result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"error: {tmp_path / 'docs.jsonl'}:61: not valid JSON")


def test_a_second_run_on_the_same_out_is_refused_with_the_holders_pid_and_host(tmp_path):
    (tmp_path / "docs.jsonl").write_bytes(jsonl_bytes(DOCS))
    with open(tmp_path / "out.lock", "w") as running:  # as a run in another process holds it
        running.write("4242 cpu-node-3\n")
        running.flush()
        fcntl.flock(running, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match=rf"^--out {tmp_path / 'out'} is being prepared by another run "
                                            r"\(pid 4242 on host cpu-node-3\): wait for it to end"):
            prepare([str(tmp_path / "docs.jsonl")], TOKENIZER, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    prepare([str(tmp_path / "docs.jsonl")], TOKENIZER, str(tmp_path / "out"), progress=False)  # released: it runs
    assert (tmp_path / "out" / "val" / "index.json").is_file()


def test_a_failed_run_names_its_partial_directory_and_that_a_rerun_continues_from_it(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(DOCS))
    (tmp_path / "b.jsonl").write_bytes(b"not json\n")
    out = tmp_path / "out"
    with pytest.raises(UserError, match="not valid JSON") as failed:
        prepare([str(tmp_path)], TOKENIZER, str(out), progress=False)
    assert failed.value.__notes__ == [f"{out}.partial/ keeps the units tokenized so far: re-running the same command "
                                      "continues from it"]  # dsv3.failures puts it in the error's line
    assert len(list((tmp_path / "out.partial" / "units").glob("*.docs"))) == 1  # a.jsonl's


def test_stdlib_units_hold_the_bundled_corpus_as_one_pass_read_it():
    """The default corpus (whose shards must not change): sorted stdlib sources up to STDLIB_MAX_CHARS, empty
    files kept, undecodable bytes replaced."""
    root = Path(sysconfig.get_paths()["stdlib"])
    expected, total = [], 0
    sources = [p for top in root.iterdir() if top.name != "site-packages"  # installed packages, not the stdlib
               for p in (top.rglob("*.py") if top.is_dir() else [top] if top.suffix == ".py" else [])]
    for path in sorted(sources, key=lambda p: p.relative_to(root).as_posix()):
        text = path.read_bytes().decode("utf-8", errors="replace")
        if total + len(text) > STDLIB_MAX_CHARS:
            break
        total += len(text)
        expected.append(text)
    units = stdlib_units()
    assert len(units) > 1 and "" in expected
    assert [doc for unit in units for doc in read_unit(unit, ReadOptions())] == expected


def test_a_lone_surrogate_in_a_jsonl_line_is_an_error_naming_file_and_line(tmp_path):
    # Valid JSON whose escape decodes to half a UTF-16 pair: not text a tokenizer can take. A whole pair is fine.
    (tmp_path / "docs.jsonl").write_text('{"text": "rocket \\ud83d\\ude80"}\n{"text": "bad \\ud800 x"}\n')
    with pytest.raises(UserError, match=r"docs\.jsonl:2: 'text' holds a lone surrogate \(an unpaired \\ud800"):
        prepare([str(tmp_path / "docs.jsonl")], TOKENIZER, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shard_tokens", [0, -1])
def test_shard_tokens_below_one_is_refused_before_tokenizing(tmp_path, monkeypatch, shard_tokens):
    def tokenize_units(*args):
        raise AssertionError("tokenized before --shard-tokens was checked")

    monkeypatch.setattr(prepare_data, "tokenize_units", tokenize_units)
    (tmp_path / "docs.jsonl").write_bytes(jsonl_bytes(DOCS[:3]))
    with pytest.raises(UserError, match=rf"--shard-tokens \({shard_tokens}\) must be positive"):
        prepare([str(tmp_path / "docs.jsonl")], TOKENIZER, str(tmp_path / "out"), shard_tokens=shard_tokens,
                progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


@pytest.mark.parametrize("vocab_size, dtype", [(65_536, "uint16"), (65_537, "uint32")])
def test_dtype_is_uint16_exactly_when_every_id_fits(tmp_path, monkeypatch, vocab_size, dtype):
    class Tokenizer_(Tokenizer):  # the bundled tokenizer, claiming a vocabulary of vocab_size ids
        def __init__(self, path: str):
            super().__init__(path)
            self.vocab_size = vocab_size

    monkeypatch.setattr(prepare_data, "Tokenizer", Tokenizer_)
    (tmp_path / "docs.jsonl").write_bytes(jsonl_bytes(DOCS[:3]))
    args = [str(tmp_path / "docs.jsonl")], TOKENIZER, str(tmp_path / "out")
    assert prepare(*args, val_fraction=0, progress=False)["train"]["dtype"] == dtype
    if dtype == "uint16":
        assert prepare(*args, val_fraction=0, dtype="uint16", progress=False)["train"]["dtype"] == "uint16"
    else:
        with pytest.raises(UserError, match=f"vocab {vocab_size} does not fit in uint16"):
            prepare(*args, val_fraction=0, dtype="uint16", progress=False)


def test_markdown_and_restructuredtext_are_text_a_file_one_document(tmp_path):
    corpus = tmp_path / "docs"
    (corpus / "sub").mkdir(parents=True)
    for i, name in enumerate(["a.txt", "b.md", "c.markdown", "sub/d.rst"]):
        (corpus / name).write_text(DOCS[i])
    gzip_md = corpus / "e.md.gz"
    gzip_md.write_bytes(gzip.compress(DOCS[4].encode()))
    files = expand_inputs([str(corpus)])
    assert [p.name for p in files] == ["a.txt", "b.md", "c.markdown", "e.md.gz", "d.rst"]
    documents = [doc for unit in plan_units(files, 1 << 20, ReadOptions()) for doc in read_unit(unit, ReadOptions())]
    assert documents == [DOCS[0], DOCS[1], DOCS[2], DOCS[4], DOCS[3]]
    assert [p.name for p in expand_inputs([str(corpus / "b.md")])] == ["b.md"]


NOT_A_CORPUS_FORMAT = "not .txt, .md, .markdown, .rst, .jsonl (each also .gz / .zst) or .parquet"


def test_what_a_directory_holds_in_no_corpus_format_is_counted_per_extension(tmp_path, capsys):
    corpus = tmp_path / "mixed"
    (corpus / "sub").mkdir(parents=True)
    for name in ["a.txt", "b.json", "sub/c.json", "d.tar.gz", "Makefile", "e.py"]:
        (corpus / name).write_text("x")
    assert [p.name for p in expand_inputs([str(corpus)])] == ["a.txt"]
    assert capsys.readouterr().out.splitlines() == [
        f"skipped {count} in {corpus}: {NOT_A_CORPUS_FORMAT}"
        for count in ("2 files (.json)", "1 file (.py)", "1 file (.tar.gz)", "1 file (no extension)")]


def test_each_shard_carries_its_size_and_checksum_the_datasets_fingerprint(tmp_path):
    (tmp_path / "docs.jsonl").write_bytes(jsonl_bytes(DOCS))
    prepare([str(tmp_path / "docs.jsonl")], TOKENIZER, str(tmp_path / "out"), progress=False, shard_tokens=300)
    index = json.loads((tmp_path / "out" / "train" / "index.json").read_text())
    assert len(index["shards"]) > 1
    for shard in index["shards"]:
        data = (tmp_path / "out" / "train" / shard["file"]).read_bytes()
        assert (len(data), shard["crc32"]) == (shard["tokens"] * 2, zlib.crc32(data))


def test_a_full_disk_while_preparing_is_one_line_naming_what_is_kept(tmp_path):
    """A real full tmpfs under --out: ENOSPC from the kernel."""
    disk = tmp_path / "disk"
    (tmp_path / "docs.jsonl").write_bytes(jsonl_bytes(DOCS * 40))
    code = (f"import sys; sys.argv = ['prepare_data.py', '--input', {str(tmp_path / 'docs.jsonl')!r}, '--out', "
            f"{str(disk / 'out')!r}, '--workers', '1']; import runpy; runpy.run_path('scripts/prepare_data.py', "
            "run_name='__main__')")
    from conftest import on_full_disk
    ended = on_full_disk(disk, 96, code)
    assert ended.returncode == 3, ended.stderr
    last = ended.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: the disk is full.* \({disk}/out\.partial/ keeps the units "
                        r"tokenized so far: re-running the same command continues from it\); free space, then run "
                        r"the same command again", last), ended.stderr


def test_sigterm_while_preparing_says_what_is_kept_and_what_to_run(tmp_path):
    (tmp_path / "docs.jsonl").write_bytes(jsonl_bytes(DOCS))
    code = f"""
import os, runpy, signal, sys
sys.argv = ["prepare_data.py", "--input", {str(tmp_path / 'docs.jsonl')!r}, "--out", {str(tmp_path / 'out')!r},
            "--workers", "1"]
import scripts.prepare_data as prepare_data
real_assemble = prepare_data.assemble
def assemble(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    return real_assemble(*args)
prepare_data.assemble = assemble
from dsv3.config import run_main
run_main(prepare_data.main)
"""
    ended = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert ended.returncode == 143, ended.stderr
    assert ended.stderr.strip().splitlines()[-1] == (f"stopped by SIGTERM ({tmp_path / 'out'}.partial/ keeps the "
                                                     "units tokenized so far: re-running the same command continues "
                                                     "from it)")
    assert not (tmp_path / "out").exists()
