import json
import re
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import scripts.prepare_data as prepare_data
from dsv3.config import UserError
from dsv3.data import MixtureLoader, PackedLoader, check_first_batch, shuffled_index
from dsv3.tokenizer import Tokenizer
from scripts.prepare_data import prepare

TOKENIZER = str(Path(__file__).resolve().parents[1] / "data" / "tokenizer.model")
DOCS = [
    f"def f{i}(x):\n    return x * {i}  # café ünïcode ✓ 数据 {i}\n" + "word " * (i % 7) for i in range(40)
]


def write_txt(root: Path, docs: list[str]) -> Path:
    root.mkdir(parents=True)
    for i, doc in enumerate(docs):
        (root / f"doc_{i:03d}.txt").write_text(doc, encoding="utf-8")
    return root


def prepared(tmp_path: Path, **kwargs) -> Path:
    out = tmp_path / "tokens"
    prepare([str(write_txt(tmp_path / "txt", DOCS))], TOKENIZER, str(out), progress=False, **kwargs)
    return out


def read_stream(split_dir: Path) -> np.ndarray:
    index = json.loads((split_dir / "index.json").read_text())
    return np.concatenate([np.fromfile(split_dir / s["file"], dtype=index["dtype"]) for s in index["shards"]])


def test_txt_jsonl_parquet_give_identical_token_streams(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": DOCS}), parquet, row_group_size=7)
    sources = {
        "txt": dict(inputs=[str(write_txt(tmp_path / "txt", DOCS))]),
        "jsonl": dict(inputs=[str(jsonl)], text_key="body"),
        "parquet": dict(inputs=[str(parquet)], column="content"),
    }
    streams = {}
    for name, source in sources.items():
        out = tmp_path / name / "tokens"
        prepare(tokenizer_path=TOKENIZER, out_dir=str(out), progress=False, **source)
        streams[name] = [read_stream(out / "train"), read_stream(out / "val")]
    for split in range(2):
        np.testing.assert_array_equal(streams["txt"][split], streams["jsonl"][split])
        np.testing.assert_array_equal(streams["txt"][split], streams["parquet"][split])


def test_every_document_ends_with_eos_and_decodes_back(tmp_path):
    out = prepared(tmp_path, val_fraction=0)
    tok = Tokenizer(TOKENIZER)
    stream = read_stream(out / "train").tolist()
    assert stream[-1] == tok.eos_id
    ends = [i for i, t in enumerate(stream) if t == tok.eos_id]
    starts = [0] + [e + 1 for e in ends[:-1]]
    assert [tok.decode(stream[a:b]) for a, b in zip(starts, ends)] == DOCS


def test_small_shard_tokens_writes_several_shards_and_loader_stitches_them(tmp_path):
    out = prepared(tmp_path, shard_tokens=100)
    index = json.loads((out / "train" / "index.json").read_text())
    assert len(index["shards"]) > 3
    assert all(s["tokens"] <= 100 for s in index["shards"]) and index["dtype"] == "uint16"
    stream = read_stream(out / "train")
    seq_len = 37  # not a divisor of 100: sequences straddle shard boundaries
    loader = PackedLoader(str(out), "train", seq_len, shuffle=False)
    assert loader.num_sequences == (len(stream) - 1) // seq_len
    batch = loader.next_batch(loader.num_sequences)
    expected = np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(loader.num_sequences)])
    assert batch.dtype == torch.long and batch.shape == (loader.num_sequences, seq_len + 1)
    np.testing.assert_array_equal(batch.numpy(), expected)


def test_val_split_is_non_empty_and_disjoint_from_train(tmp_path):
    out = prepared(tmp_path, val_fraction=0.1)  # 40 documents: a 1% whole-document split cannot exist
    train, val = (json.loads((out / s / "index.json").read_text()) for s in ("train", "val"))
    assert val["num_documents"] >= 1 and val["num_tokens"] > 0
    assert train["num_documents"] + val["num_documents"] == len(DOCS)
    two = tmp_path / "two"
    prepare([str(write_txt(tmp_path / "two_docs", DOCS[:2]))], TOKENIZER, str(two), progress=False)
    assert json.loads((two / "val" / "index.json").read_text())["num_documents"] == 1


def test_loader_resume_is_exact(tmp_path):
    out = prepared(tmp_path)
    uninterrupted = PackedLoader(str(out), "train", 16, seed=3)
    assert uninterrupted.num_sequences % 6  # so some batches straddle an epoch boundary
    batches = [uninterrupted.next_batch(6) for _ in range(3 * uninterrupted.num_sequences // 6)]
    k = len(batches) // 2 + 1
    first = PackedLoader(str(out), "train", 16, seed=3)
    for _ in range(k):
        first.next_batch(6)
    resumed = PackedLoader(str(out), "train", 16, seed=99)  # the seed comes from the state
    resumed.load_state_dict(first.state_dict())
    for expected in batches[k:]:
        torch.testing.assert_close(resumed.next_batch(6), expected)


def test_epochs_are_fresh_permutations_of_all_sequences(tmp_path):
    out = prepared(tmp_path)
    loader = PackedLoader(str(out), "train", 16, seed=0)
    n = loader.num_sequences
    epochs = [loader.next_batch(n) for _ in range(2)]
    in_order = PackedLoader(str(out), "train", 16, shuffle=False).next_batch(n)
    for epoch in epochs:
        assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, in_order.tolist()))
    assert not torch.equal(epochs[0], epochs[1])


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4097])
def test_shuffled_index_is_a_permutation_for_any_n(n):
    order = shuffled_index(np.arange(n), n, seed=5, epoch=2)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == list(range(n))


def test_shuffled_index_differs_across_epochs_and_seeds_and_is_reproducible():
    n = 1000
    order = shuffled_index(np.arange(n), n, seed=0, epoch=0)
    assert not np.array_equal(order, np.arange(n))
    assert not np.array_equal(order, shuffled_index(np.arange(n), n, seed=0, epoch=1))
    assert not np.array_equal(order, shuffled_index(np.arange(n), n, seed=1, epoch=0))
    np.testing.assert_array_equal(order, shuffled_index(np.arange(n), n, seed=0, epoch=0))
    # a slice of places gives the same sequences as the whole order does there: ranks need only their own rows
    np.testing.assert_array_equal(shuffled_index(np.arange(300, 340), n, seed=0, epoch=0), order[300:340])


def test_shuffled_index_of_a_huge_corpus_needs_memory_for_the_batch_only():
    n = 3_600_000_000  # the paper's 14.8T tokens in sequences of 4096
    tracemalloc.start()
    batch = shuffled_index(np.arange(10_000, 11_024), n, seed=0, epoch=3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20  # a permutation of n int64 would take 27 GiB
    assert len(set(batch.tolist())) == len(batch) and 0 <= batch.min() and batch.max() < n
    assert batch.max() > n // 2  # spread over the corpus, not clustered near the start


def test_rank_slices_concatenate_to_the_single_process_batch(tmp_path):
    out = prepared(tmp_path)
    single = PackedLoader(str(out), "train", 16, seed=1)
    four = [PackedLoader(str(out), "train", 16, rank=r, world_size=4, seed=1) for r in range(4)]
    for _ in range(3):
        batch = single.next_batch(8)
        slices = [loader.next_batch(8) for loader in four]
        assert all(s.shape == (2, 17) for s in slices)
        torch.testing.assert_close(torch.cat(slices), batch)
    # resharded resume: a 4-rank state continues on 2 ranks with the same global batches
    two = [PackedLoader(str(out), "train", 16, rank=r, world_size=2, seed=1) for r in range(2)]
    for loader in two:
        loader.load_state_dict(four[0].state_dict())
    for _ in range(2 * single.num_sequences // 8):
        torch.testing.assert_close(torch.cat([loader.next_batch(8) for loader in two]), single.next_batch(8))


def test_global_batch_must_divide_by_world_size(tmp_path):
    loader = PackedLoader(str(prepared(tmp_path)), "train", 16, rank=1, world_size=3)
    with pytest.raises(ValueError, match="not divisible by world_size 3"):
        loader.next_batch(8)


def test_empty_corpus_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no .txt, .jsonl or .parquet files"):
        prepare([str(empty)], TOKENIZER, str(tmp_path / "out"), progress=False)
    (empty / "blank.txt").write_text("")
    with pytest.raises(UserError, match="no non-empty documents"):
        prepare([str(empty)], TOKENIZER, str(tmp_path / "out"), progress=False)


def test_missing_jsonl_key_or_parquet_column_is_a_clear_error(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(UserError, match="no key 'text'.*--text-key"):
        prepare([str(jsonl)], TOKENIZER, str(tmp_path / "out"), progress=False)
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": ["hello"]}), parquet)
    with pytest.raises(UserError, match="no column 'text'.*--column"):
        prepare([str(parquet)], TOKENIZER, str(tmp_path / "out"), progress=False)
    pq.write_table(pa.table({"text": [1, 2]}), parquet)
    with pytest.raises(UserError, match="column 'text' holds int64, not text"):
        prepare([str(parquet)], TOKENIZER, str(tmp_path / "out"), progress=False)


@pytest.mark.parametrize("damage,found", [("truncate", r"has \d+ bytes"), ("index-claims-fewer", r"has \d+ bytes"),
                                          ("delete", "is missing")])
def test_a_shard_that_does_not_match_its_index_is_one_line_naming_the_file(tmp_path, damage, found):
    out = prepared(tmp_path)
    shard, index_path = out / "train" / "shard_00000.bin", out / "train" / "index.json"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-7])
    elif damage == "index-claims-fewer":
        index = json.loads(index_path.read_text())
        index["shards"][0]["tokens"] -= 10
        index_path.write_text(json.dumps(index))
    else:
        shard.unlink()
    with pytest.raises(UserError, match=rf"^{shard} {found}, but {index_path} says \d+ uint16 tokens"):
        PackedLoader(str(out), "train", seq_len=16)


def test_ids_beyond_the_vocabulary_are_one_line_in_any_batch_not_an_index_error_later(tmp_path):
    """Another tokenizer's ids in a shard of the right size, past the first batch: every batch is checked against
    its index.json's vocab_size (one max over its ids), so step 11 stops as step 1 would, naming the split."""
    out = prepared(tmp_path)
    shard = out / "train" / "shard_00000.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    vocab = json.loads((out / "train" / "index.json").read_text())["vocab_size"]
    loader = MixtureLoader([("tokens", str(out), 1.0)], "train", seq_len=16, shuffle=False)
    tokens[16 * 40 + 1:] = vocab + 10  # sequence 40 on (its first token is sequence 39's last)
    tokens.tofile(shard)
    check_first_batch(loader, 4, vocab_size=vocab)
    for _ in range(10):
        loader.next_batch(4)
    with pytest.raises(UserError, match=rf"^{out / 'train'} holds token id {vocab + 10} \(in sequence 40\), but its "
                                        rf"index.json says vocab_size {vocab}: its shards do not match their index"):
        loader.next_batch(4)


def test_uint16_shards_refuse_a_vocab_over_65535(tmp_path, monkeypatch):
    class BigTokenizer(Tokenizer):
        def __init__(self, path):
            super().__init__(path)
            self.vocab_size = 100_000

    monkeypatch.setattr(prepare_data, "Tokenizer", BigTokenizer)
    docs = [str(write_txt(tmp_path / "txt", DOCS))]
    with pytest.raises(UserError, match="vocab 100000 does not fit in uint16"):
        prepare(docs, TOKENIZER, str(tmp_path / "out"), dtype="uint16", progress=False)
    prepare(docs, TOKENIZER, str(tmp_path / "out"), progress=False)  # the default picks uint32
    assert json.loads((tmp_path / "out" / "train" / "index.json").read_text())["dtype"] == "uint32"
    assert PackedLoader(str(tmp_path / "out"), "train", 16).next_batch(2).shape == (2, 17)


def test_prepare_with_a_missing_tokenizer_names_the_script_that_trains_one(tmp_path):
    with pytest.raises(UserError, match="scripts/train_tokenizer.py"):
        prepare([str(write_txt(tmp_path / "txt", DOCS))], str(tmp_path / "nope.model"), str(tmp_path / "out"))


def test_missing_data_dir_names_the_script_that_writes_it(tmp_path):
    with pytest.raises(UserError, match="scripts/prepare_data.py"):
        PackedLoader(str(tmp_path / "nowhere"), "train", 16)


def test_dataset_shorter_than_one_sequence_is_a_clear_error(tmp_path):
    out = prepared(tmp_path)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedLoader(str(out), "val", 10_000)


def test_failed_rerun_leaves_the_previous_dataset_intact(tmp_path, monkeypatch):
    out = prepared(tmp_path, shard_tokens=100)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    calls = 0

    def encode_then_fail(self, texts, num_threads=1):
        nonlocal calls
        calls += 1
        if calls > 1:
            raise RuntimeError("killed mid-run")
        return Tokenizer.encode_batch(self, texts, num_threads)

    many = write_txt(tmp_path / "many", DOCS * 10)  # a unit per .txt file: the second one fails
    monkeypatch.setattr(prepare_data.Tokenizer, "encode_batch", encode_then_fail)
    with pytest.raises(RuntimeError, match="killed mid-run"):
        prepare([str(many)], TOKENIZER, str(out), shard_tokens=100, progress=False)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    # nothing left behind but the finished units, kept for a re-run, and the lock file (no longer held)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many", "tokens", "tokens.lock", "tokens.partial", "txt"]


def test_rerun_replaces_the_dataset_and_drops_its_extra_shards(tmp_path):
    out = prepared(tmp_path, shard_tokens=100)
    prepare([str(write_txt(tmp_path / "few", DOCS[:4]))], TOKENIZER, str(out), val_fraction=0.25, progress=False)
    index = json.loads((out / "train" / "index.json").read_text())
    assert [p.name for p in sorted((out / "train").glob("shard_*.bin"))] == ["shard_00000.bin"]
    assert index["num_documents"] == 3


def test_out_that_is_not_a_dataset_is_refused(tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    with pytest.raises(UserError, match="not a prepared dataset.*new directory"):
        prepare([str(write_txt(tmp_path / "txt", DOCS))], TOKENIZER, str(out), progress=False)
    assert (out / "notes.md").read_text() == "mine"


def test_binary_file_is_refused_by_name(tmp_path):
    corpus = write_txt(tmp_path / "txt", DOCS[:3])
    (corpus / "model.txt").write_bytes(b"\x7fELF\x02\x01\x00\x00binary")
    with pytest.raises(UserError, match=r"model\.txt looks binary"):
        prepare([str(corpus)], TOKENIZER, str(tmp_path / "out"), progress=False)


def test_non_utf8_text_names_file_and_line_unless_an_encoding_is_given(tmp_path):
    corpus = tmp_path / "latin"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes("first line\nsecond\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"a\.txt:3: not valid utf-8 \(byte 0xe9\).*--encoding latin-1"):
        prepare([str(corpus)], TOKENIZER, str(tmp_path / "out"), progress=False)
    prepare([str(corpus)], TOKENIZER, str(tmp_path / "out"), progress=False, encoding="latin-1")
    stream = read_stream(tmp_path / "out" / "train").tolist() + read_stream(tmp_path / "out" / "val").tolist()
    assert "café au lait" in Tokenizer(TOKENIZER).decode([t for t in stream if t != Tokenizer(TOKENIZER).eos_id])


@pytest.mark.parametrize("bad_line, reason", [
    (b'{"text": "cut off', r"not valid JSON \(Unterminated string"),
    (b'["a list"]', "a JSON list, not an object"),
    (b'{"text": 7}', "'text' is a int, not a string"),
    (b'{"body": "x"}', "no key 'text'"),
    ('{"text": "caf\xe9"}'.encode("latin-1"), r"not valid utf-8 \(byte 0xe9\)"),
])
def test_bad_jsonl_line_is_reported_as_file_and_line(tmp_path, bad_line, reason):
    jsonl = tmp_path / "docs.jsonl"
    good = json.dumps({"text": "fine"}).encode()
    jsonl.write_bytes(b"\n".join([good, b"", good, bad_line, good]) + b"\n")
    with pytest.raises(UserError, match=rf"docs\.jsonl:4: {reason}"):
        prepare([str(jsonl)], TOKENIZER, str(tmp_path / "out"), progress=False)


def test_one_document_corpus_still_gets_a_validation_split(tmp_path):
    corpus = write_txt(tmp_path / "one", ["".join(DOCS)])
    prepare([str(corpus)], TOKENIZER, str(tmp_path / "out"), val_fraction=0.1, progress=False)
    train, val = read_stream(tmp_path / "out" / "train"), read_stream(tmp_path / "out" / "val")
    whole = np.array(Tokenizer(TOKENIZER).encode_batch(["".join(DOCS)])[0] + [Tokenizer(TOKENIZER).eos_id])
    assert len(val) == round(0.1 * len(whole)) and len(train) + len(val) == len(whole)
    np.testing.assert_array_equal(np.concatenate([train, val]), whole)  # val is the tail, nothing lost
    assert PackedLoader(str(tmp_path / "out"), "val", 16).num_sequences > 0


def test_the_missing_and_too_short_data_messages_name_the_exact_fix(tmp_path):
    nowhere = tmp_path / "nowhere"
    with pytest.raises(UserError, match=f"--out {re.escape(str(nowhere))}`$"):
        PackedLoader(str(nowhere), "train", 16)
    out = prepared(tmp_path)
    with pytest.raises(UserError, match="or train without validation: --train.val_every=0$"):
        PackedLoader(str(out), "val", 10_000)
    with pytest.raises(UserError, match="use a shorter seq_len or more data$"):
        PackedLoader(str(out), "train", 10_000_000)


@pytest.mark.parametrize("damage,message", [
    (lambda text: text[:len(text) // 2], "is not valid JSON"),
    (lambda text: "[1, 2]", "holds a list, not an index"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "shards"}), "has no 'shards'"),
    (lambda text: json.dumps({**json.loads(text), "vocab_size": "4096"}), "has a str as 'vocab_size'"),
    (lambda text: json.dumps({**json.loads(text), "shards": [{"file": 3}]}), "has a shard entry"),
    (lambda text: json.dumps({**json.loads(text), "dtype": "int17"}), "names dtype 'int17'"),
], ids=["truncated", "not-an-object", "missing-key", "wrong-type", "bad-shard-entry", "bad-dtype"])
def test_a_damaged_index_is_one_line_naming_it_and_the_fix(tmp_path, damage, message):
    out = prepared(tmp_path)
    index_path = out / "train" / "index.json"
    index_path.write_text(damage(index_path.read_text()))
    with pytest.raises(UserError, match=rf"^{index_path} {re.escape(message)}.*re-run scripts/prepare_data.py"):
        PackedLoader(str(out), "train", seq_len=16)


@pytest.mark.parametrize("name", ["/etc/passwd", "../../secret.bin", "sub/../../x.bin"])
def test_shard_names_cannot_reach_outside_their_split(tmp_path, name):
    out = prepared(tmp_path)
    index_path = out / "train" / "index.json"
    index = json.loads(index_path.read_text())
    index["shards"][0]["file"] = name
    index_path.write_text(json.dumps(index))
    with pytest.raises(UserError, match=rf"^{index_path} names shard {re.escape(repr(name))}, outside "):
        PackedLoader(str(out), "train", seq_len=16)


def test_a_shard_that_is_a_link_is_refused(tmp_path):
    out = prepared(tmp_path)
    shard = out / "train" / "shard_00000.bin"
    elsewhere = tmp_path / "elsewhere.bin"
    shard.rename(elsewhere)
    shard.symlink_to(elsewhere)
    with pytest.raises(UserError, match=rf"^{shard} is a symbolic link"):
        PackedLoader(str(out), "train", seq_len=16)


def test_a_re_prepared_dataset_with_the_same_size_is_refused_on_resume(tmp_path):
    """Same number of sequences, other tokens: the shards' checksums (index.json) tell them apart."""
    out = prepared(tmp_path)
    loader = PackedLoader(str(out), "train", seq_len=16)
    loader.next_batch(4)
    state = loader.state_dict()
    assert state["fingerprint"]
    index_path = out / "train" / "index.json"
    index = json.loads(index_path.read_text())
    shard = out / "train" / index["shards"][0]["file"]
    tokens = np.fromfile(shard, dtype=index["dtype"])
    np.flip(tokens).tofile(shard)  # as prepare_data.py writes a re-prepared dataset: new bytes, new checksum
    index["shards"][0]["crc32"] = zlib.crc32(shard.read_bytes())
    index_path.write_text(json.dumps(index))
    with pytest.raises(UserError, match=rf"^{out / 'train'} holds other tokens than the run was trained on .*"
                                        r"Resume with the dataset the run started on, or start a new run"):
        PackedLoader(str(out), "train", seq_len=16).load_state_dict(state)


def test_a_dataset_or_checkpoint_from_before_fingerprints_still_resumes(tmp_path):
    out = prepared(tmp_path)
    old_state = {k: v for k, v in PackedLoader(str(out), "train", seq_len=16).state_dict().items()
                 if k != "fingerprint"}
    PackedLoader(str(out), "train", seq_len=16).load_state_dict(old_state)
    index_path = out / "train" / "index.json"
    index = json.loads(index_path.read_text())
    for shard in index["shards"]:
        del shard["crc32"]
    index_path.write_text(json.dumps(index))
    loader = PackedLoader(str(out), "train", seq_len=16)
    assert "fingerprint" not in loader.state_dict()
    loader.load_state_dict({**old_state, "fingerprint": "0-1"})
