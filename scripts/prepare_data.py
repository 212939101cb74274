"""Tokenize a corpus into token shards for dsv3.data.PackedLoader.

    python scripts/prepare_data.py                                    # bundled default: stdlib → data/stdlib
    python scripts/prepare_data.py --input corpus/ --out data/mine    # .txt / .jsonl / .parquet, recursive

Writes OUT/{train,val}/shard_NNNNN.bin (raw token ids, EOS after every document) and index.json.
Documents go to val by position (the 2nd, then every k-th), so the split is deterministic and streams.
OUT is written beside itself under a temporary name and swapped in only when complete: a failed run
leaves an existing dataset as it was. Text is read as UTF-8 (or --encoding); binary files are refused.
"""

import argparse
import itertools
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file without installing dsv3
from dsv3.config import UserError, run_main  # noqa: E402
from dsv3.tokenizer import Tokenizer  # noqa: E402

SUFFIXES = (".txt", ".jsonl", ".parquet")
STDLIB_MAX_CHARS = 20_000_000
BINARY_SNIFF_BYTES = 8192  # a NUL byte this early means a binary file, not text


def stdlib_documents(max_chars: int = STDLIB_MAX_CHARS) -> Iterator[str]:
    """The bundled default corpus: this Python's standard library *.py files, sorted by path, one per document.

    Always present and offline; the cap keeps it at ~20 MB of text.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    total = 0
    for path in files:
        # A few stdlib test files are deliberately not UTF-8; replace rather than skip, for determinism.
        text = path.read_bytes().decode("utf-8", errors="replace")
        if total + len(text) > max_chars:
            return
        total += len(text)
        yield text


def expand_inputs(inputs: list[str]) -> list[Path]:
    files = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise UserError(f"{path} is not .txt, .jsonl or .parquet; convert it or pass a directory of those.")
            files.append(path)
        else:
            raise UserError(f"input {path} does not exist; pass existing files or directories with --input.")
    if not files:
        raise UserError(f"no .txt, .jsonl or .parquet files in {inputs}; point --input at your corpus.")
    return files


def decode_text(data: bytes, path: Path, encoding: str, first_line: int = 1) -> str:
    """`data` decoded strictly; a decoding error names the file and the line of the first bad byte."""
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        raise UserError(
            f"{path}:{line}: not valid {encoding} (byte 0x{data[e.start]:02x}); convert the file to UTF-8, "
            "or pass its real encoding, e.g. --encoding latin-1."
        ) from None
    except LookupError:
        raise UserError(f"--encoding {encoding!r} is not an encoding Python knows; try utf-8 or latin-1.") from None


def refuse_binary(path: Path, head: bytes) -> None:
    if b"\0" in head[:BINARY_SNIFF_BYTES]:
        raise UserError(f"{path} looks binary (a NUL byte in its first {BINARY_SNIFF_BYTES} bytes), "
                        "not text; remove it from --input.")


def read_jsonl(path: Path, text_key: str, encoding: str) -> Iterator[str]:
    """The `text_key` string of every non-blank line; a bad line is reported as `file:line: reason`."""
    with path.open("rb") as f:  # split on b"\n" only, so line numbers are an editor's line numbers
        refuse_binary(path, f.peek(BINARY_SNIFF_BYTES))
        for line_no, raw in enumerate(f, 1):
            line = decode_text(raw, path, encoding, line_no)
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{line_no}: not valid JSON ({e.msg}, column {e.colno}); "
                                "each line must be one JSON object.") from None
            if not isinstance(record, dict):
                raise UserError(f"{path}:{line_no}: a JSON {type(record).__name__}, not an object; "
                                f'each line must be an object like {{"{text_key}": "..."}}.')
            if text_key not in record:
                raise UserError(
                    f"{path}:{line_no}: no key {text_key!r} (keys: {sorted(record)}); choose one with --text-key."
                )
            if not isinstance(record[text_key], str):
                raise UserError(f"{path}:{line_no}: {text_key!r} is a {type(record[text_key]).__name__}, "
                                "not a string; choose the text field with --text-key.")
            yield record[text_key]


def read_documents(path: Path, text_key: str = "text", column: str = "text",
                   encoding: str = "utf-8") -> Iterator[str]:
    if path.suffix == ".txt":
        data = path.read_bytes()
        refuse_binary(path, data)
        yield decode_text(data, path, encoding)
    elif path.suffix == ".jsonl":
        yield from read_jsonl(path, text_key, encoding)
    else:
        parquet = pq.ParquetFile(path)
        if column not in parquet.schema_arrow.names:
            raise UserError(
                f"{path} has no column {column!r} (columns: {parquet.schema_arrow.names}); choose one with --column."
            )
        column_type = parquet.schema_arrow.field(column).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise UserError(f"{path}: column {column!r} holds {column_type}, not text; choose one with --column.")
        # Batches of rows, never the whole table: parquet corpora are often larger than RAM.
        for batch in parquet.iter_batches(batch_size=1024, columns=[column]):
            yield from batch.column(0).to_pylist()


def iter_documents(inputs: list[str] | None, text_key: str = "text", column: str = "text",
                   encoding: str = "utf-8") -> Iterator[str]:
    """Non-empty documents of the inputs in a fixed order; the stdlib corpus when inputs is empty."""
    if not inputs:
        yield from stdlib_documents()
        return
    for path in expand_inputs(inputs):
        for doc in read_documents(path, text_key, column, encoding):
            if doc:
                yield doc


class ShardWriter:
    """Appends tokens to shard_NNNNN.bin files of at most shard_tokens tokens each."""

    def __init__(self, split_dir: Path, dtype: str, shard_tokens: int):
        split_dir.mkdir(parents=True)
        self.split_dir, self.dtype, self.shard_tokens = split_dir, dtype, shard_tokens
        self.counts: list[int] = []
        self.file = None
        self.documents = 0

    def add_document(self, tokens: np.ndarray) -> None:
        self.documents += 1
        while len(tokens):  # a document may straddle two shards; the loader stitches them
            if self.file is None or self.counts[-1] == self.shard_tokens:
                self._next_shard()
            take = min(len(tokens), self.shard_tokens - self.counts[-1])
            self.file.write(tokens[:take].tobytes())
            self.counts[-1] += take
            tokens = tokens[take:]

    def pop_tail(self, n: int) -> np.ndarray:
        """Remove the last n tokens (n <= total) from the shards and return them."""
        if self.file is not None:
            self.file.close()
            self.file = None
        itemsize = np.dtype(self.dtype).itemsize
        parts = []
        while n:
            path = self.split_dir / f"shard_{len(self.counts) - 1:05d}.bin"
            keep = max(self.counts[-1] - n, 0)
            parts.insert(0, np.fromfile(path, self.dtype, offset=keep * itemsize))
            n -= self.counts[-1] - keep
            if keep:
                os.truncate(path, keep * itemsize)
                self.counts[-1] = keep
            else:
                path.unlink()
                self.counts.pop()
        return np.concatenate(parts)

    def _next_shard(self) -> None:
        if self.file is not None:
            self.file.close()
        self.file = open(self.split_dir / f"shard_{len(self.counts):05d}.bin", "wb")
        self.counts.append(0)

    def close(self, tokenizer: Tokenizer) -> dict:
        if self.file is not None:
            self.file.close()
        index = {
            "dtype": self.dtype,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "bos_id": tokenizer.bos_id,
            "tokenizer": str(tokenizer.path),
            "num_tokens": sum(self.counts),
            "num_documents": self.documents,
            "shards": [{"file": f"shard_{i:05d}.bin", "tokens": n} for i, n in enumerate(self.counts)],
        }
        (self.split_dir / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        return index


def prepare(
    inputs: list[str] | None,
    tokenizer_path: str = "data/tokenizer.model",
    out_dir: str = "data/stdlib",
    text_key: str = "text",
    column: str = "text",
    val_fraction: float = 0.01,
    shard_tokens: int = 50_000_000,
    dtype: str | None = None,
    num_threads: int = 1,
    progress: bool = True,
    encoding: str = "utf-8",
) -> dict[str, dict]:
    """Tokenize `inputs` (None or [] = the stdlib corpus) into OUT/{train,val}; returns both indexes.

    OUT is replaced only when everything is written. With val_fraction > 0 val is never empty: when no
    whole document falls to it (a one-document corpus), it gets the last val_fraction of the train tokens."""
    if not 0 <= val_fraction <= 0.5:
        raise UserError(f"--val-fraction {val_fraction} is outside [0, 0.5]; pick e.g. 0.01.")
    tokenizer = Tokenizer(tokenizer_path)
    dtype = dtype or ("uint16" if tokenizer.vocab_size <= 65535 else "uint32")
    if tokenizer.vocab_size > np.iinfo(dtype).max:
        raise UserError(
            f"tokenizer vocab {tokenizer.vocab_size} does not fit in {dtype}; use --dtype uint32 or omit --dtype."
        )
    out = Path(out_dir)
    if out.is_file() or (out.is_dir() and not set(os.listdir(out)) <= {"train", "val"}):
        raise UserError(f"--out {out} exists and is not a prepared dataset (only train/ and val/ may be in it); "
                        "it would be replaced: choose a new directory.")
    documents = iter_documents(inputs, text_key, column, encoding)
    first = next(documents, None)  # fail before touching out_dir
    if first is None:
        raise UserError(f"the corpus {inputs} has no non-empty documents; check --input, --text-key, --column.")
    staging = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        indexes = write_splits(itertools.chain([first], documents), tokenizer, staging, dtype, val_fraction,
                               shard_tokens, num_threads, progress)
        swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return indexes


def swap_in(staging: Path, out: Path) -> None:
    """Replace out by staging with two renames: a reader finds the old dataset or the new one, never a mix
    (between the renames, for an instant, neither)."""
    retired = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(retired)
    staging.rename(out)
    shutil.rmtree(retired, ignore_errors=True)  # open memmaps of a running job stay valid (POSIX)


def write_splits(documents: Iterator[str], tokenizer: Tokenizer, out: Path, dtype: str, val_fraction: float,
                 shard_tokens: int, num_threads: int, progress: bool) -> dict[str, dict]:
    """Tokenize documents into out/{train,val}; returns both indexes."""
    # Doc 1, then every k-th: val is non-empty as soon as there are two documents, and train gets doc 0.
    val_every = round(1 / val_fraction) if val_fraction > 0 else 0
    writers = {split: ShardWriter(out / split, dtype, shard_tokens) for split in ("train", "val")}
    bar = tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=not progress)
    n_docs, batch = 0, []  # batches of documents so sentencepiece can encode them on several threads

    def flush() -> None:
        nonlocal n_docs
        for ids in tokenizer.encode_batch(batch, num_threads=num_threads):
            split = "val" if val_every and n_docs % val_every == 1 else "train"
            writers[split].add_document(np.array(ids + [tokenizer.eos_id], dtype=dtype))
            n_docs += 1
            bar.update(len(ids) + 1)
        batch.clear()

    for doc in documents:
        batch.append(doc)
        if len(batch) == 256:
            flush()
    flush()
    bar.close()
    train_tokens = sum(writers["train"].counts)
    if val_every and not writers["val"].documents:
        if train_tokens < 2:
            raise UserError(f"the corpus is {train_tokens} token(s), too small to split; add documents, "
                            "or pass --val-fraction 0 and train with --train.val_every=0.")
        tail = max(1, round(val_fraction * train_tokens))
        print(f"note: {n_docs} document(s) give val no whole document; val gets the last {tail} tokens of "
              "train instead (more documents give a document-level split)", file=sys.stderr)
        writers["val"].add_document(writers["train"].pop_tail(tail))
    return {split: writer.close(tokenizer) for split, writer in writers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="*", default=None, help="files or directories; default: the stdlib corpus")
    parser.add_argument("--tokenizer", default="data/tokenizer.model")
    parser.add_argument("--out", default="data/stdlib")
    parser.add_argument("--text-key", default="text", help="jsonl field holding the document")
    parser.add_argument("--column", default="text", help="parquet column holding the document")
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--shard-tokens", type=int, default=50_000_000)
    parser.add_argument("--dtype", choices=["uint16", "uint32"], default=None, help="default: by vocab size")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="sentencepiece encoding threads")
    parser.add_argument("--encoding", default="utf-8", help=".txt/.jsonl text encoding, e.g. latin-1")
    args = parser.parse_args()
    indexes = prepare(
        args.input, args.tokenizer, args.out, args.text_key, args.column,
        args.val_fraction, args.shard_tokens, args.dtype, args.threads, encoding=args.encoding,
    )
    for split, index in indexes.items():
        print(f"{split}: {index['num_documents']} documents, {index['num_tokens']:,} tokens, "
              f"{len(index['shards'])} shards in {Path(args.out) / split}")


if __name__ == "__main__":
    run_main(main)
