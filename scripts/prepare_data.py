"""Tokenize a corpus into token shards for dsv3.data.PackedLoader.

    python scripts/prepare_data.py                                    # bundled default: stdlib → data/stdlib
    python scripts/prepare_data.py --input corpus/ --out data/mine    # .txt / .jsonl / .parquet, recursive

Writes OUT/{train,val}/shard_NNNNN.bin (raw token ids, EOS after every document) and index.json.
Documents go to val by position (the 2nd, then every k-th), so the split is deterministic and streams.
"""

import argparse
import itertools
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file without installing dsv3
from dsv3.config import UserError, run_main  # noqa: E402
from dsv3.data import Tokenizer  # noqa: E402

SUFFIXES = (".txt", ".jsonl", ".parquet")
STDLIB_MAX_CHARS = 20_000_000


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


def read_documents(path: Path, text_key: str = "text", column: str = "text") -> Iterator[str]:
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8", errors="replace")
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if text_key not in record:
                    raise UserError(
                        f"{path}:{line_no} has no key {text_key!r} (keys: {sorted(record)}); "
                        "choose one with --text-key."
                    )
                yield record[text_key]
    else:
        parquet = pq.ParquetFile(path)
        if column not in parquet.schema_arrow.names:
            raise UserError(
                f"{path} has no column {column!r} (columns: {parquet.schema_arrow.names}); choose one with --column."
            )
        # Batches of rows, never the whole table: parquet corpora are often larger than RAM.
        for batch in parquet.iter_batches(batch_size=1024, columns=[column]):
            yield from batch.column(0).to_pylist()


def iter_documents(inputs: list[str] | None, text_key: str = "text", column: str = "text") -> Iterator[str]:
    """Non-empty documents of the inputs in a fixed order; the stdlib corpus when inputs is empty."""
    if not inputs:
        yield from stdlib_documents()
        return
    for path in expand_inputs(inputs):
        for doc in read_documents(path, text_key, column):
            if doc:
                yield doc


class ShardWriter:
    """Appends tokens to shard_NNNNN.bin files of at most shard_tokens tokens each."""

    def __init__(self, split_dir: Path, dtype: str, shard_tokens: int):
        split_dir.mkdir(parents=True, exist_ok=True)
        for stale in split_dir.glob("shard_*.bin"):  # a previous run may have written more shards
            stale.unlink()
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
) -> dict[str, dict]:
    """Tokenize `inputs` (None or [] = the stdlib corpus) into OUT/{train,val}; returns both indexes."""
    if not 0 <= val_fraction <= 0.5:
        raise UserError(f"--val-fraction {val_fraction} is outside [0, 0.5]; pick e.g. 0.01.")
    tokenizer = Tokenizer(tokenizer_path)
    dtype = dtype or ("uint16" if tokenizer.vocab_size <= 65535 else "uint32")
    if tokenizer.vocab_size > np.iinfo(dtype).max:
        raise UserError(
            f"tokenizer vocab {tokenizer.vocab_size} does not fit in {dtype}; use --dtype uint32 or omit --dtype."
        )
    documents = iter_documents(inputs, text_key, column)
    first = next(documents, None)  # fail before touching out_dir
    if first is None:
        raise UserError(f"the corpus {inputs} has no non-empty documents; check --input, --text-key, --column.")
    # Doc 1, then every k-th: val is non-empty as soon as there are two documents, and train gets doc 0.
    val_every = round(1 / val_fraction) if val_fraction > 0 else 0
    writers = {split: ShardWriter(Path(out_dir) / split, dtype, shard_tokens) for split in ("train", "val")}
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

    for doc in itertools.chain([first], documents):
        batch.append(doc)
        if len(batch) == 256:
            flush()
    flush()
    bar.close()
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
    args = parser.parse_args()
    indexes = prepare(
        args.input, args.tokenizer, args.out, args.text_key, args.column,
        args.val_fraction, args.shard_tokens, args.dtype, args.threads,
    )
    for split, index in indexes.items():
        print(f"{split}: {index['num_documents']} documents, {index['num_tokens']:,} tokens, "
              f"{len(index['shards'])} shards in {Path(args.out) / split}")


if __name__ == "__main__":
    run_main(main)
