"""The tokenizer: a sentencepiece model or a Hugging Face `tokenizer.json`, behind one interface.

DeepSeek-V3/V2 ship a `tokenizer.json` (byte-level BPE, opened with the `tokenizers` library, not transformers)
and a `tokenizer_config.json` naming BOS / EOS and `add_bos_token`; scripts/train_tokenizer.py writes a
sentencepiece `.model` or the same HF layout. `encode` never adds special tokens: the data pipeline puts EOS
after every document and, when `add_bos` is set, BOS before it, which gives the ids transformers' tokenizer
gives for that text.
"""

import hashlib
import json
import shutil
from functools import cached_property
from pathlib import Path

import sentencepiece as spm
import tokenizers

from dsv3.config import UserError

HF_FILE, HF_CONFIG, SP_FILE = "tokenizer.json", "tokenizer_config.json", "tokenizer.model"


class Tokenizer:
    """A sentencepiece model file, a tokenizer.json file, or a directory holding tokenizer.json (preferred,
    with tokenizer_config.json beside it) or tokenizer.model. Ids are plain ints."""

    kind: str  # "sentencepiece" | "hf"
    path: Path  # the file opened
    vocab_size: int  # ids a model must embed: max id + 1, added / special tokens included
    bos_id: int | None
    eos_id: int  # put after every document
    add_bos: bool  # put BOS before every document (HF: tokenizer_config.json's add_bos_token; sentencepiece: no)

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            path = _file_in(path)
        if not path.is_file():
            raise UserError(f"tokenizer {path} not found; train one with `python scripts/train_tokenizer.py` "
                            "or pass a sentencepiece .model, a tokenizer.json or a directory holding one")
        self.path = path
        with path.open("rb") as f:
            first = f.read(1)
        if path.suffix == ".json" or first == b"{":  # a sentencepiece model is a proto, whose first byte is a tag
            self._open_hf(path)
        else:
            self._open_sentencepiece(path)
        if self.eos_id is None:
            raise UserError(f"tokenizer {path} names no EOS token, which dsv3 puts after every document; "
                            f"name one (eos_token in {HF_CONFIG}, or eos_id when training a sentencepiece model)")

    def _open_sentencepiece(self, path: Path) -> None:
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise UserError(f"tokenizer {path} is neither a sentencepiece model nor a Hugging Face "
                            f"{HF_FILE} ({e}); pass one, or train one with `python scripts/train_tokenizer.py`")
        self.kind = "sentencepiece"
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.add_bos = False  # our sentencepiece data has always been EOS-separated only

    def _open_hf(self, path: Path) -> None:
        try:
            self._hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise UserError(f"tokenizer {path} is not a valid Hugging Face {HF_FILE} ({e}); "
                            "pass another, or train one with `python scripts/train_tokenizer.py --kind hf-bpe`")
        # A tokenizer.json may carry truncation / padding for some fine-tuning task: documents must stay whole.
        self._hf.no_truncation()
        self._hf.no_padding()
        self.kind = "hf"
        self.vocab_size = max(self._hf.get_vocab(with_added_tokens=True).values()) + 1
        config_path = path.with_name(HF_CONFIG)
        if not config_path.is_file():
            raise UserError(f"tokenizer {path} has no {HF_CONFIG} beside it to name its BOS / EOS tokens; write "
                            'one, e.g. {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}')
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{config_path} is not valid JSON ({e}); fix or rewrite it")
        if not isinstance(config, dict):
            raise UserError(f"{config_path} is not a JSON object; fix or rewrite it")
        self._config_path = config_path
        self.bos_id = self._special_id(config, "bos_token")
        self.eos_id = self._special_id(config, "eos_token")
        # transformers 4 adds BOS as add_bos_token says; 5 ignores the flag beside a tokenizer.json and follows its
        # post-processor. Files saved by transformers 4 (DeepSeek's LlamaTokenizerFast) and by train_tokenizer.py
        # agree; the flag wins where set.
        if self.bos_id is None:
            self.add_bos = False
        elif "add_bos_token" in config:
            self.add_bos = bool(config["add_bos_token"])
        else:
            self.add_bos = self._hf.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]

    def _special_id(self, config: dict, key: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # {"__type": "AddedToken", "content": ...}
            token = token.get("content")
        if token is None:
            return None
        if not isinstance(token, str):
            raise UserError(f"{self._config_path}: {key} is {token!r}, not a token; write the token's text there")
        token_id = self._hf.token_to_id(token)
        if token_id is None:
            raise UserError(f"{self._config_path} names {key} {token!r}, which the vocabulary of {self.path} "
                            f"lacks; name a token of {self.path} there")
        return token_id

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of what fixes the text ↔ id mapping: equal for copies of one tokenizer, different otherwise."""
        if self.kind == "sentencepiece":
            return hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()
        # The library's own serialization (truncation and padding were turned off at open) is deterministic;
        # hashing it as text, not re-serialized JSON, keeps a 129k-id vocabulary's fingerprint under a second.
        specials = json.dumps({"bos_id": self.bos_id, "eos_id": self.eos_id, "add_bos": self.add_bos})
        return hashlib.sha256((self._hf.to_str() + specials).encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, no BOS / EOS added."""
        if self.kind == "sentencepiece":
            return self._sp.encode(text)
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """encode() of each text. sentencepiece uses num_threads threads. The HF library encodes a batch on its
        Rust thread pool, which sizes itself (RAYON_NUM_THREADS, default all cores) and runs serially under
        TOKENIZERS_PARALLELISM=false or in a process forked after the pool started; num_threads=1 keeps the
        batch on this thread, so the pool never starts."""
        if self.kind == "sentencepiece":
            return self._sp.encode(texts, num_threads=num_threads)
        if num_threads <= 1:
            return [self.encode(text) for text in texts]
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; BOS / EOS and other special tokens decode to nothing (as sentencepiece does)."""
        if self.kind == "sentencepiece":
            return self._sp.decode(list(ids))
        return self._hf.decode(list(ids), skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        """Copy this tokenizer's files into `directory`, which Tokenizer(directory) then opens (and, for an HF
        tokenizer, transformers.AutoTokenizer.from_pretrained too). Files of the other kind there are removed."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.kind == "sentencepiece":
            copies, stale = {self.path: SP_FILE}, (HF_FILE, HF_CONFIG)
        else:
            copies, stale = {self.path: HF_FILE, self._config_path: HF_CONFIG}, (SP_FILE,)
        for source, name in copies.items():
            if source.resolve() != (directory / name).resolve():
                shutil.copyfile(source, directory / name)
        for name in stale:
            (directory / name).unlink(missing_ok=True)


def _file_in(directory: Path) -> Path:
    for name in (HF_FILE, SP_FILE):
        if (directory / name).is_file():
            return directory / name
    raise UserError(f"directory {directory} holds no {HF_FILE} or {SP_FILE}; pass the tokenizer's own directory "
                    "or file, or train one with `python scripts/train_tokenizer.py`")


def find_tokenizer(directory: str | Path) -> Tokenizer | None:
    """The tokenizer saved in a dataset / checkpoint / export directory, None if it holds none."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in (HF_FILE, SP_FILE)):
        return None
    return Tokenizer(directory)
