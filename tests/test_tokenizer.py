import json
import multiprocessing
import shutil
import sys
from pathlib import Path

import pytest
import tokenizers

import scripts.train_tokenizer as train_tokenizer_script
from dsv3.config import UserError
from dsv3.tokenizer import Tokenizer, find_tokenizer
from scripts.train_tokenizer import train_tokenizer

SENTENCEPIECE = Path(__file__).resolve().parents[1] / "data" / "tokenizer.model"
TEXTS = [
    "",
    "def main():\n    return 42\n",
    "  trailing  spaces\t\ttabs\n\n\n        deep indent",
    "naïve café — 数据 データ 🚀 Ωμέγα 12345678",
    "x = {'a': [1, 2.5e-3]}  # comment\r\n",
]


def auto_tokenizer(directory: Path):
    """transformers' own reading of the directory (local files only)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def copy_of(directory: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(directory, tmp_path / name))


def edit_config(directory: Path, **changes) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


def test_sentencepiece_round_trips_ascii_and_unicode_without_bos():
    tok = Tokenizer(SENTENCEPIECE)
    assert (tok.kind, tok.path, tok.vocab_size) == ("sentencepiece", SENTENCEPIECE, 4096)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.eos_id not in ids and tok.bos_id not in ids
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS, num_threads=2) == [tok.encode(t) for t in TEXTS]


def test_missing_tokenizer_names_the_script_that_trains_one(tmp_path):
    with pytest.raises(UserError, match="nope.model.*scripts/train_tokenizer.py"):
        Tokenizer(tmp_path / "nope.model")


def test_hf_ids_equal_transformers_autotokenizer_bos_included(deepseek_tokenizer_dir):
    tok = Tokenizer(deepseek_tokenizer_dir)
    assert (tok.kind, tok.path) == ("hf", deepseek_tokenizer_dir / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (0, 1, True)
    reference = auto_tokenizer(deepseek_tokenizer_dir)
    for text in TEXTS + ["a special token <｜end▁of▁sentence｜> inside text"]:
        assert [tok.bos_id] + tok.encode(text) == reference(text)["input_ids"], text


def test_hf_round_trips_text_and_batches_like_single_encodes(deepseek_tokenizer_dir):
    tok = Tokenizer(deepseek_tokenizer_dir)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.bos_id] + tok.encode("hi") + [tok.eos_id]) == "hi"
    singles = [tok.encode(t) for t in TEXTS]
    assert tok.encode_batch(TEXTS, num_threads=1) == singles
    assert tok.encode_batch(TEXTS, num_threads=2) == singles


def test_truncation_or_padding_in_tokenizer_json_never_cuts_or_pads_a_document(deepseek_tokenizer_dir, tmp_path):
    directory = copy_of(deepseek_tokenizer_dir, tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    hf.enable_truncation(max_length=4)
    hf.enable_padding(length=64, pad_id=2, pad_token="<｜▁pad▁｜>")
    hf.save(str(directory / "tokenizer.json"))
    tok, reference = Tokenizer(directory), Tokenizer(deepseek_tokenizer_dir)
    assert tok.encode_batch(TEXTS, num_threads=2) == [reference.encode(t) for t in TEXTS]
    assert tok.fingerprint == reference.fingerprint


def _encode_in_child(directory: Path) -> list[list[int]]:
    return Tokenizer(directory).encode_batch(TEXTS, num_threads=2)


def test_hf_encode_batch_works_in_a_worker_forked_after_the_parent_used_the_thread_pool(deepseek_tokenizer_dir):
    tok = Tokenizer(deepseek_tokenizer_dir)
    expected = tok.encode_batch(TEXTS * 50, num_threads=2)[: len(TEXTS)]  # starts the Rust pool in this process
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply_async(_encode_in_child, (deepseek_tokenizer_dir,)).get(timeout=60) == expected


def test_config_tokens_may_be_plain_strings(deepseek_tokenizer_dir, tmp_path):
    plain = copy_of(deepseek_tokenizer_dir, tmp_path)
    edit_config(plain, bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>")
    tok, reference = Tokenizer(plain), Tokenizer(deepseek_tokenizer_dir)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (reference.bos_id, reference.eos_id, reference.add_bos)
    assert tok.fingerprint == reference.fingerprint


@pytest.mark.parametrize("post_processor, adds_bos", [("bos template", True), ("byte level", False)])
def test_without_add_bos_token_the_post_processor_decides_as_in_transformers(
    deepseek_tokenizer_dir, tmp_path, post_processor, adds_bos
):
    directory = copy_of(deepseek_tokenizer_dir, tmp_path)
    edit_config(directory, add_bos_token=None, add_eos_token=None)
    if post_processor == "byte level":
        hf = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        hf.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
        hf.save(str(directory / "tokenizer.json"))
    tok = Tokenizer(directory)
    assert tok.add_bos is adds_bos
    assert [tok.bos_id] * tok.add_bos + tok.encode(TEXTS[1]) == auto_tokenizer(directory)(TEXTS[1])["input_ids"]


def test_vocab_size_covers_the_special_tokens(deepseek_tokenizer_dir):
    tok = Tokenizer(deepseek_tokenizer_dir)
    reference = auto_tokenizer(deepseek_tokenizer_dir)
    assert tok.vocab_size == len(reference) == 384
    assert reference.convert_tokens_to_ids("<｜Assistant｜>") == tok.vocab_size - 1  # added after the BPE vocab


def test_file_and_directory_open_the_same_tokenizer(deepseek_tokenizer_dir):
    by_dir, by_file = Tokenizer(deepseek_tokenizer_dir), Tokenizer(deepseek_tokenizer_dir / "tokenizer.json")
    assert by_dir.path == by_file.path
    assert len(by_dir.fingerprint) == 64 and by_dir.fingerprint == by_file.fingerprint
    assert Tokenizer(SENTENCEPIECE.parent).path == SENTENCEPIECE  # a directory holding only tokenizer.model


def test_saved_copies_keep_the_fingerprint_and_load_in_transformers(deepseek_tokenizer_dir, tmp_path):
    hf = Tokenizer(deepseek_tokenizer_dir)
    hf.save(tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert Tokenizer(tmp_path / "hf").fingerprint == hf.fingerprint
    assert auto_tokenizer(tmp_path / "hf")(TEXTS[3])["input_ids"] == [hf.bos_id] + hf.encode(TEXTS[3])

    sp = Tokenizer(SENTENCEPIECE)
    sp.save(tmp_path / "sp")
    assert Tokenizer(tmp_path / "sp").fingerprint == sp.fingerprint
    sp.save(tmp_path / "hf")  # the HF files would shadow the new tokenizer.model
    assert Tokenizer(tmp_path / "hf").fingerprint == sp.fingerprint


def test_different_tokenizers_have_different_fingerprints(deepseek_tokenizer_dir, tmp_path):
    no_bos = copy_of(deepseek_tokenizer_dir, tmp_path, "no_bos")
    edit_config(no_bos, add_bos_token=False)
    more_tokens = copy_of(deepseek_tokenizer_dir, tmp_path, "more_tokens")
    hf = tokenizers.Tokenizer.from_file(str(more_tokens / "tokenizer.json"))
    hf.add_special_tokens(["<｜tool▁sep｜>"])
    hf.save(str(more_tokens / "tokenizer.json"))
    fingerprints = [Tokenizer(p).fingerprint for p in (deepseek_tokenizer_dir, no_bos, more_tokens, SENTENCEPIECE)]
    assert len(set(fingerprints)) == 4


def test_find_tokenizer_returns_the_saved_one_or_none(deepseek_tokenizer_dir, tmp_path):
    assert find_tokenizer(deepseek_tokenizer_dir).fingerprint == Tokenizer(deepseek_tokenizer_dir).fingerprint
    assert find_tokenizer(SENTENCEPIECE.parent).kind == "sentencepiece"
    assert find_tokenizer(tmp_path) is None
    assert find_tokenizer(tmp_path / "absent") is None


def bad_inputs(deepseek_tokenizer_dir: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name → (path given to Tokenizer, path its error names)."""
    text = tmp_path / "notes.txt"
    text.write_text("just some text\n")
    corrupt = tmp_path / "corrupt" / "tokenizer.json"
    corrupt.parent.mkdir()
    corrupt.write_text('{"version": "1.0", "model": {')
    not_a_tokenizer = tmp_path / "other.json"
    not_a_tokenizer.write_text('{"hello": "world"}')
    empty = tmp_path / "empty"
    empty.mkdir()
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(deepseek_tokenizer_dir / "tokenizer.json", no_config)
    unknown_eos = copy_of(deepseek_tokenizer_dir, tmp_path, "unknown_eos")
    edit_config(unknown_eos, eos_token="</s>")
    unknown_bos = copy_of(deepseek_tokenizer_dir, tmp_path, "unknown_bos")
    edit_config(unknown_bos, bos_token={"__type": "AddedToken", "content": "<s>"})
    no_eos = copy_of(deepseek_tokenizer_dir, tmp_path, "no_eos")
    edit_config(no_eos, eos_token=None)
    bad_config = copy_of(deepseek_tokenizer_dir, tmp_path, "bad_config")
    (bad_config / "tokenizer_config.json").write_text("{not json")
    return {
        "missing path": (tmp_path / "absent", tmp_path / "absent"),
        "text file": (text, text),
        "corrupt tokenizer.json": (corrupt.parent, corrupt),
        "json that is no tokenizer": (not_a_tokenizer, not_a_tokenizer),
        "directory without a tokenizer": (empty, empty),
        "tokenizer.json without tokenizer_config.json": (no_config, no_config / "tokenizer.json"),
        "eos the vocabulary lacks": (unknown_eos, unknown_eos / "tokenizer.json"),
        "bos the vocabulary lacks": (unknown_bos, unknown_bos / "tokenizer.json"),
        "config naming no eos": (no_eos, no_eos / "tokenizer.json"),
        "config that is not json": (bad_config, bad_config / "tokenizer_config.json"),
    }


def test_each_bad_input_is_one_user_error_naming_the_path(deepseek_tokenizer_dir, tmp_path):
    for name, (path, named) in bad_inputs(deepseek_tokenizer_dir, tmp_path).items():
        with pytest.raises(UserError) as error:
            Tokenizer(path)
        message = str(error.value)
        assert str(named) in message and "\n" not in message, name


def test_train_tokenizer_hf_bpe_output_loads_in_dsv3_and_transformers_with_equal_ids(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TEXTS[1:] * 20):
        (corpus / f"doc_{i:03d}.txt").write_text(f"{text} {i}\n", encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["train_tokenizer.py", "--kind", "hf-bpe", "--input", str(corpus),
                                      "--out", str(tmp_path / "hf"), "--vocab-size", "400"])
    train_tokenizer_script.main()
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tok = Tokenizer(tmp_path / "hf")
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == ("hf", 400, 0, 1, True)
    reference = auto_tokenizer(tmp_path / "hf")
    for text in TEXTS + ["text the corpus never saw: ĳ ß ∑ 🦀"]:
        assert tok.decode(tok.encode(text)) == text
        assert [tok.bos_id] + tok.encode(text) == reference(text)["input_ids"]

    again = train_tokenizer([str(corpus)], str(tmp_path / "again"), vocab_size=400, kind="hf-bpe")
    smaller = train_tokenizer([str(corpus)], str(tmp_path / "smaller"), vocab_size=300, kind="hf-bpe")
    assert Tokenizer(again).fingerprint == tok.fingerprint  # deterministic
    assert Tokenizer(smaller).fingerprint != tok.fingerprint
    with pytest.raises(UserError, match="--vocab-size 200"):
        train_tokenizer([str(corpus)], str(tmp_path / "tiny"), vocab_size=200, kind="hf-bpe")


def test_train_tokenizer_default_kind_writes_a_sentencepiece_model(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(TEXTS) * 40, encoding="utf-8")
    path = train_tokenizer([str(corpus)], str(tmp_path / "sp"), vocab_size=400, num_threads=1)
    assert path == tmp_path / "sp.model"
    tok = Tokenizer(path)
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == ("sentencepiece", 400, 1, 2, False)
    assert all(tok.decode(tok.encode(text)) == text for text in TEXTS)


def test_train_tokenizer_reads_the_corpus_in_the_encoding_given(tmp_path, monkeypatch):
    corpus = tmp_path / "latin.txt"
    corpus.write_bytes(("café crème déjà vu\n" * 200).encode("latin-1"))
    out = str(tmp_path / "sp")
    with pytest.raises(UserError, match=r"latin\.txt:1: not valid utf-8 .* --encoding latin-1"):
        train_tokenizer([str(corpus)], out, vocab_size=300, num_threads=1)
    monkeypatch.setattr(sys, "argv", ["train_tokenizer.py", "--input", str(corpus), "--out", out,
                                      "--vocab-size", "300", "--threads", "1", "--encoding", "latin-1"])
    train_tokenizer_script.main()
    assert len(Tokenizer(out + ".model").encode("é")) == 1  # learned as a character, not two UTF-8 byte pieces


def test_a_failed_write_leaves_the_previous_sentencepiece_model_whole(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(TEXTS) * 40, encoding="utf-8")
    path = train_tokenizer([str(corpus)], str(tmp_path / "sp"), vocab_size=400, num_threads=1)
    before = path.read_bytes()

    def write_half_then_fail(self: Path, data: bytes) -> int:  # as a full disk or a kill mid-write
        with self.open("wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        train_tokenizer([str(corpus)], str(tmp_path / "sp"), vocab_size=400, num_threads=1)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "sp.model"]  # no half-written file left
