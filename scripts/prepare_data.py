"""Tokenize a corpus into token shards for dsv3.data.PackedLoader.

    python scripts/prepare_data.py                                    # bundled default: stdlib → data/stdlib
    python scripts/prepare_data.py --input corpus/ --out data/mine    # .txt .md .rst .jsonl .parquet, .gz .zst

Writes OUT/{train,val}/shard_NNNNN.bin (raw token ids; each document is [BOS if the tokenizer adds one] ids EOS),
index.json per split, and OUT/tokenizer/ (the tokenizer the ids belong to). Documents go to val by position
(the 2nd, then every k-th), so the split is deterministic whatever the number of workers.

Work is split into units (dsv3.corpus: a file, a --chunk-mb byte range of a plain .jsonl, or row groups of a
parquet file) that --workers processes tokenize into OUT.partial/units/; the dataset is then assembled from
them in corpus order, byte-identical for any number of workers. A killed run re-run with the same arguments
reuses the finished units. OUT is swapped in only when complete: a failed run leaves an existing dataset as
it was. One run at a time prepares an OUT: it holds an OS lock on OUT.lock (pid and host inside) until it ends.
Text is read as UTF-8 (or --encoding); binary files are refused.

Memory does not grow with the corpus: a worker holds one batch of documents (BATCH_DOCS, or BATCH_CHARS of
text, and their ids) and its read buffers; the assembly one unit's document lengths. A .txt file is one
document and is held whole by the worker that tokenizes it.
"""

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import multiprocessing.pool
import os
import shutil
import sys
import zlib
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, BinaryIO

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file without installing dsv3
from dsv3.config import TrainConfig, UserError, run_main  # noqa: E402
from dsv3.corpus import ReadOptions, Unit, expand_inputs, plan_units, read_unit, stdlib_units  # noqa: E402
from dsv3.lockfile import take_lock  # noqa: E402
from dsv3.tokenizer import Tokenizer  # noqa: E402

CHUNK_BYTES = 32 << 20  # plain .jsonl bytes (or parquet bytes) per unit: work for a few seconds per worker
BATCH_DOCS, BATCH_CHARS = 256, 1 << 22  # documents encoded per call, and the text a worker holds at once
COPY_BYTES = 16 << 20  # assembly copies unit files to shards in pieces of this size
MAX_VAL_SHARE = 2  # whole-document val may hold up to this many times --val-fraction of the tokens
MIN_VAL_TOKENS = TrainConfig.seq_len + 1  # one validation sequence at train.py's default seq_len


def iter_documents(inputs: list[str] | None, text_key: str = "text", column: str = "text",
                   encoding: str = "utf-8") -> Iterator[str]:
    """Non-empty documents of the inputs in corpus order; the stdlib corpus when inputs is empty."""
    options = ReadOptions(text_key, column, encoding)
    for unit in corpus_units(inputs, CHUNK_BYTES, options):
        yield from read_unit(unit, options)


def corpus_units(inputs: list[str] | None, chunk_bytes: int, options: ReadOptions) -> list[Unit]:
    return plan_units(expand_inputs(inputs), chunk_bytes, options) if inputs else stdlib_units()


def prepare(
    inputs: list[str] | None,
    tokenizer_path: str = "data/tokenizer.model",
    out_dir: str = "data/stdlib",
    text_key: str = "text",
    column: str = "text",
    val_fraction: float = 0.01,
    shard_tokens: int = 50_000_000,
    dtype: str | None = None,
    workers: int = 1,
    progress: bool = True,
    encoding: str = "utf-8",
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, dict]:
    """Tokenize `inputs` (None or [] = the stdlib corpus) into OUT/{train,val}; returns both indexes.

    OUT is replaced only when everything is written; OUT.partial keeps finished units until then, for a re-run.
    With val_fraction > 0 val is never empty: when no whole document falls to it (a one-document corpus), or
    whole documents would be more than MAX_VAL_SHARE × val_fraction of the tokens, it gets the last
    val_fraction of the token stream."""
    if not 0 <= val_fraction <= 0.5:
        raise UserError(f"--val-fraction {val_fraction} is outside [0, 0.5]; pick e.g. 0.01.")
    if workers < 1 or chunk_bytes < 1 or shard_tokens < 1:
        raise UserError(f"--workers ({workers}), --chunk-mb and --shard-tokens ({shard_tokens}) must be positive.")
    tokenizer = Tokenizer(tokenizer_path)
    max_id = tokenizer.vocab_size - 1
    dtype = dtype or ("uint16" if max_id <= np.iinfo(np.uint16).max else "uint32")
    if max_id > np.iinfo(dtype).max:
        raise UserError(
            f"tokenizer vocab {tokenizer.vocab_size} does not fit in {dtype}; use --dtype uint32 or omit --dtype."
        )
    out = Path(out_dir)
    if out.is_file() or (out.is_dir() and not set(os.listdir(out)) <= {"train", "val", "tokenizer"}):
        raise UserError(f"--out {out} exists and is not a prepared dataset (only train/, val/ and tokenizer/ may "
                        "be in it); it would be replaced: choose a new directory.")
    options = ReadOptions(text_key, column, encoding)
    units = corpus_units(inputs, chunk_bytes, options)
    staging = out.with_name(f"{out.name}.partial")
    with lock_out(out), named_on_failure(staging):
        unit_files = tokenize_units(units, staging, tokenizer, dtype, options, workers, progress)
        dataset = staging / "dataset"
        shutil.rmtree(dataset, ignore_errors=True)  # an assembly that a killed run left half done
        indexes = assemble(unit_files, dataset, tokenizer, dtype, val_fraction, shard_tokens, inputs)
        tokenizer.save(dataset / "tokenizer")
        swap_in(dataset, out)
    # renamed first: a kill inside rmtree must not leave an OUT.partial without its manifest, which blocks reruns
    done = staging.with_name(f"{staging.name}.done")
    shutil.rmtree(done, ignore_errors=True)  # what a run killed in this removal left
    staging.rename(done)
    shutil.rmtree(done)
    return indexes


def lock_out(out: Path) -> IO:
    """An OS lock on OUT.lock (beside OUT, which is swapped in by renames), held until the returned file closes or
    the process dies: a second run on the same --out is refused with the holder's pid and host."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = open(out.with_name(f"{out.name}.lock"), "a+")
    holder = take_lock(lock)
    if holder is not None:
        raise UserError(f"--out {out} is being prepared by another run (pid {holder[0]} on host {holder[1]}): wait "
                        "for it to end, or choose another --out")
    return lock


@contextlib.contextmanager
def named_on_failure(staging: Path) -> Iterator[None]:
    """A failure says where the finished work waits, in its one line (dsv3.failures prints the error's notes)."""
    kept = f"{staging}/ keeps the units tokenized so far: re-running the same command continues from it"
    try:
        yield
    except BaseException as e:
        if staging.is_dir():
            e.add_note(kept)
        raise


# ---- tokenizing units: OUT.partial/units/<key>.bin (tokens) + <key>.docs (int64 document lengths) ----


def tokenize_units(units: list[Unit], staging: Path, tokenizer: Tokenizer, dtype: str, options: ReadOptions,
                   workers: int, progress: bool) -> list[Path]:
    """Tokenize every unit not already in staging; returns each unit's file stem (+ .bin / .docs), in order."""
    settings = {"tokenizer_fingerprint": tokenizer.fingerprint, "dtype": dtype, **asdict(options)}
    units_dir = open_staging(staging, settings)
    stems = [units_dir / unit_key(unit) for unit in units]
    todo = [(unit, stem) for unit, stem in zip(units, stems) if not is_finished(stem, dtype)]
    if len(todo) < len(units):
        print(f"note: resuming from {staging}: {len(units) - len(todo)} of {len(units)} units are already "
              "tokenized", file=sys.stderr)
    for leftover in units_dir.glob("*.tmp-*"):  # a killed worker's unfinished file
        leftover.unlink()
    # Workers fork before the bar starts its monitor thread: a process should fork while it has one thread.
    workers = min(workers, len(todo))
    pool = start_workers(tokenizer, dtype, options, workers) if workers > 1 else None
    try:
        # The bar is a `with` block so that it ends its line before an error reaches stderr.
        with tqdm(total=len(units), initial=len(units) - len(todo), desc="tokenizing", unit="unit",
                  disable=not progress) as bar:
            if pool:  # in unit order, so that the first failing unit in corpus order is the one reported
                counts = pool.imap(run_unit, todo)
            else:
                counts = (tokenize_unit(unit, stem, tokenizer, dtype, options) for unit, stem in todo)
            tokens = 0
            for count in counts:
                tokens += count
                bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
                bar.update()
    except BaseException:
        if pool:
            pool.terminate()
        raise
    if pool:  # every unit done: the workers exit on their own (a pool's `with` terminates them, which once hung)
        pool.close()
        pool.join()
    return stems


def start_workers(tokenizer: Tokenizer, dtype: str, options: ReadOptions, workers: int) -> multiprocessing.pool.Pool:
    """`workers` processes that each tokenize one unit at a time (run_unit)."""
    # fork starts workers in milliseconds; elsewhere (macOS) fork is unsafe and spawn is the default.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    # Workers encode on their own thread (num_threads=1). Had this process run HF tokenizers' thread pool, each
    # forked worker would print a warning about it, unless the variable is set when the worker forks.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return context.Pool(workers, initializer=init_worker, initargs=(str(tokenizer.path), dtype, options))
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


_worker: tuple[Tokenizer, str, ReadOptions] | None = None  # a worker process's tokenizer and settings


def init_worker(tokenizer_path: str, dtype: str, options: ReadOptions) -> None:
    global _worker
    _worker = Tokenizer(tokenizer_path), dtype, options


def run_unit(task: tuple[Unit, Path]) -> int:
    return tokenize_unit(*task, *_worker)


def tokenize_unit(unit: Unit, stem: Path, tokenizer: Tokenizer, dtype: str, options: ReadOptions) -> int:
    """Write the unit's documents as [BOS] ids EOS to stem.bin and their lengths to stem.docs, each under a
    temporary name first, .docs last: a unit is finished once its .docs exists. Returns its token count."""
    prefix = [tokenizer.bos_id] if tokenizer.add_bos else []
    tokens_tmp, docs_tmp = (stem.with_name(f"{stem.name}{ext}.tmp-{os.getpid()}") for ext in (".bin", ".docs"))
    total = 0
    with tokens_tmp.open("wb") as tokens_file, docs_tmp.open("wb") as docs_file:
        batch, chars = [], 0

        def flush() -> None:
            nonlocal total
            flat, lengths = [], []
            for ids in tokenizer.encode_batch(batch, num_threads=1):
                flat += prefix
                flat += ids
                flat.append(tokenizer.eos_id)
                lengths.append(len(prefix) + len(ids) + 1)
            tokens_file.write(np.array(flat, dtype=dtype).tobytes())
            docs_file.write(np.array(lengths, dtype=np.int64).tobytes())
            total += len(flat)
            batch.clear()

        for doc in read_unit(unit, options):
            batch.append(doc)
            chars += len(doc)
            if len(batch) == BATCH_DOCS or chars >= BATCH_CHARS:
                flush()
                chars = 0
        if batch:
            flush()
    tokens_tmp.rename(stem.with_suffix(".bin"))
    docs_tmp.rename(stem.with_suffix(".docs"))
    return total


def doc_lengths(stem: Path) -> np.ndarray:
    return np.fromfile(stem.with_suffix(".docs"), np.int64)


def is_finished(stem: Path, dtype: str) -> bool:
    tokens = stem.with_suffix(".bin")
    return (stem.with_suffix(".docs").is_file() and tokens.is_file()
            and tokens.stat().st_size == int(doc_lengths(stem).sum()) * np.dtype(dtype).itemsize)


def unit_key(unit: Unit) -> str:
    """A name for the unit's files that changes when its input file does (size or modification time)."""
    stat = Path(unit.path).stat()
    identity = [unit.kind, str(Path(unit.path).resolve()), unit.start, unit.stop, stat.st_size, stat.st_mtime_ns]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]


def open_staging(staging: Path, settings: dict) -> Path:
    """staging/units, kept from an earlier run with the same settings (tokenizer, dtype, reading options) and
    emptied otherwise; returns it."""
    manifest = staging / "manifest.json"
    if staging.exists():
        if not manifest.is_file() and any(staging.iterdir()):
            raise UserError(f"{staging} exists and is not a prepare_data staging directory (no manifest.json); "
                            "move it away: prepare_data keeps unfinished work there.")
        if manifest.is_file() and json.loads(manifest.read_text()) != settings:
            print(f"note: {staging} holds units of another tokenizer, --dtype or reading options; starting it "
                  "afresh", file=sys.stderr)
            shutil.rmtree(staging)
    (staging / "units").mkdir(parents=True, exist_ok=True)
    if not manifest.is_file():
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps(settings, indent=1) + "\n")
        tmp.rename(manifest)
    return staging / "units"


# ---- assembly: the val split by global document position, and shards copied from the unit files ----


class ShardWriter:
    """Appends tokens to shard_NNNNN.bin files of at most shard_tokens tokens each."""

    def __init__(self, split_dir: Path, dtype: str, shard_tokens: int):
        split_dir.mkdir(parents=True)
        self.split_dir, self.dtype, self.shard_tokens = split_dir, dtype, shard_tokens
        self.itemsize = np.dtype(dtype).itemsize
        self.counts: list[int] = []
        self.crcs: list[int] = []  # each shard's crc32: the dataset's fingerprint, checked when a run resumes
        self.file = None
        self.documents = 0

    def copy(self, source: BinaryIO, start: int, count: int) -> None:
        """Append tokens [start, start + count) of a unit file; a document may straddle two shards (the
        loader stitches them)."""
        source.seek(start * self.itemsize)
        while count:
            if self.file is None or self.counts[-1] == self.shard_tokens:
                self._next_shard()
            take = min(count, self.shard_tokens - self.counts[-1], COPY_BYTES // self.itemsize)
            tokens = source.read(take * self.itemsize)
            self.file.write(tokens)
            self.crcs[-1] = zlib.crc32(tokens, self.crcs[-1])
            self.counts[-1] += take
            count -= take

    def _next_shard(self) -> None:
        if self.file is not None:
            self.file.close()
        self.file = open(self.split_dir / f"shard_{len(self.counts):05d}.bin", "wb")
        self.counts.append(0)
        self.crcs.append(0)

    def close(self, tokenizer: Tokenizer) -> dict:
        if self.file is not None:
            self.file.close()
        index = {
            "dtype": self.dtype,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "bos_id": tokenizer.bos_id,
            "add_bos": tokenizer.add_bos,
            "tokenizer": str(tokenizer.path),
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "num_tokens": sum(self.counts),
            "num_documents": self.documents,
            "shards": [{"file": f"shard_{i:05d}.bin", "tokens": n, "crc32": crc}
                       for i, (n, crc) in enumerate(zip(self.counts, self.crcs))],
        }
        (self.split_dir / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        return index


def count_documents(unit_files: list[Path], val_every: int) -> tuple[int, int, int, int]:
    """(documents, tokens, val documents, val tokens) of the corpus, val by the whole-document rule."""
    n_docs = n_tokens = val_docs = val_tokens = 0
    for stem in unit_files:
        docs = doc_lengths(stem)
        if val_every:
            in_val = docs[(1 - n_docs) % val_every :: val_every]
            val_docs, val_tokens = val_docs + len(in_val), val_tokens + int(in_val.sum())
        n_docs, n_tokens = n_docs + len(docs), n_tokens + int(docs.sum())
    return n_docs, n_tokens, val_docs, val_tokens


def assemble(unit_files: list[Path], out: Path, tokenizer: Tokenizer, dtype: str, val_fraction: float,
             shard_tokens: int, inputs: list[str] | None) -> dict[str, dict]:
    """Write out/{train,val} from the unit files in order; returns both indexes. Streams: one unit's document
    lengths in memory at a time, tokens copied file to file."""
    # Doc 1, then every k-th: val is non-empty as soon as there are two documents, and train gets doc 0.
    val_every = round(1 / val_fraction) if val_fraction > 0 else 0
    n_docs, n_tokens, val_docs, val_tokens = count_documents(unit_files, val_every)
    if not n_docs:
        raise UserError(f"the corpus {inputs} has no non-empty documents; check --input, --text-key, --column.")
    tail = 0  # val is the last `tail` tokens of the stream instead of whole documents
    if val_every and (not val_docs or val_tokens > MAX_VAL_SHARE * val_fraction * n_tokens):
        if n_tokens < 2:
            raise UserError(f"the corpus is {n_tokens} token(s), too small to split; add documents, "
                            "or pass --val-fraction 0 and train with --train.val_every=0.")
        tail = max(1, round(val_fraction * n_tokens))
        why = (f"{n_docs} document(s) give val no whole document" if not val_docs else
               f"whole documents would put {val_tokens / n_tokens:.1%} of the tokens in val ({val_docs} of {n_docs} "
               f"documents), over {MAX_VAL_SHARE}× --val-fraction {val_fraction:g}")
        print(f"note: {why}; val gets the last {tail} tokens of the stream instead (more documents give a "
              "document-level split)", file=sys.stderr)
    writers = {split: ShardWriter(out / split, dtype, shard_tokens) for split in ("train", "val")}
    train, val = writers["train"], writers["val"]
    first_doc = first_token = 0  # of the unit, in the whole corpus
    for stem in unit_files:
        docs = doc_lengths(stem)
        size = int(docs.sum())
        with stem.with_suffix(".bin").open("rb") as source:
            if tail:
                cut = min(max(n_tokens - tail - first_token, 0), size)  # this unit's tokens before the tail
                train.copy(source, 0, cut)
                val.copy(source, cut, size - cut)
            else:
                starts = np.concatenate([[0], np.cumsum(docs)])
                position = 0
                in_val = range((1 - first_doc) % val_every, len(docs), val_every) if val_every else range(0)
                for i in in_val:
                    train.copy(source, position, int(starts[i]) - position)
                    val.copy(source, int(starts[i]), int(docs[i]))
                    position = int(starts[i + 1])
                train.copy(source, position, size - position)
        first_doc, first_token = first_doc + len(docs), first_token + size
    train.documents, val.documents = (n_docs, 1) if tail else (n_docs - val_docs, val_docs)
    if val_every and (val_size := tail or val_tokens) < MIN_VAL_TOKENS:
        print(f"warning: val is {val_size} tokens, fewer than the {MIN_VAL_TOKENS} (seq_len + 1) that train.py "
              f"validates with at its default seq_len {MIN_VAL_TOKENS - 1}; give it more with --val-fraction "
              "or more data, or train with a shorter --train.seq_len or --train.val_every=0", file=sys.stderr)
    return {split: writer.close(tokenizer) for split, writer in writers.items()}


def swap_in(staging: Path, out: Path) -> None:
    """Replace out by staging with two renames: a reader finds the old dataset or the new one, never a mix
    (between the renames, for an instant, neither)."""
    retired = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(retired)
    staging.rename(out)
    shutil.rmtree(retired, ignore_errors=True)  # open memmaps of a running job stay valid (POSIX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="*", default=None, help="files or directories; default: the stdlib corpus")
    parser.add_argument("--tokenizer", default="data/tokenizer.model",
                        help="a sentencepiece .model, a tokenizer.json, or a directory holding one")
    parser.add_argument("--out", default="data/stdlib")
    parser.add_argument("--text-key", default="text", help="jsonl field holding the document")
    parser.add_argument("--column", default="text", help="parquet column holding the document")
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--shard-tokens", type=int, default=50_000_000)
    parser.add_argument("--dtype", choices=["uint16", "uint32"], default=None, help="default: by vocab size")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizing processes (default: the CPU count)")
    parser.add_argument("--chunk-mb", type=float, default=CHUNK_BYTES / 2**20,
                        help="MiB of a plain .jsonl (or of parquet row groups) per unit of work")
    parser.add_argument("--encoding", default="utf-8", help=".txt/.jsonl text encoding, e.g. latin-1")
    args = parser.parse_args()
    indexes = prepare(
        args.input, args.tokenizer, args.out, args.text_key, args.column, args.val_fraction, args.shard_tokens,
        args.dtype, args.workers, encoding=args.encoding, chunk_bytes=int(args.chunk_mb * 2**20),
    )
    for split, index in indexes.items():
        print(f"{split}: {index['num_documents']} documents, {index['num_tokens']:,} tokens, "
              f"{len(index['shards'])} shards in {Path(args.out) / split}")


if __name__ == "__main__":
    run_main(main)
