"""The documents of a text corpus, read in units that processes can tokenize independently.

Formats: `.txt` and Markdown / reStructuredText (`.md`, `.markdown`, `.rst`; a file is one document, read as
text), `.jsonl` (a string field of every line), `.parquet` (a string column), each also as `.gz` / `.zst` except
parquet (compressed inside). A directory's other files are skipped and counted by extension. With no inputs, the
corpus is this Python's standard library sources. A `Unit` is a whole file, the lines of a plain `.jsonl` that
start in a byte range, or a run of a parquet file's row groups; units depend on the files and `chunk_bytes` only,
so any number of workers sees the same ones. Bad input is a `UserError` naming the file and line (or, in a
corrupt compressed file, the compressed byte offset).
"""

import functools
import io
import json
import os
import sysconfig
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zstandard

from dsv3.config import UserError

if TYPE_CHECKING:
    import pyarrow.parquet

TEXT_FORMATS = (".txt", ".md", ".markdown", ".rst")  # a file is one document
FORMATS = (*TEXT_FORMATS, ".jsonl", ".parquet")
COMPRESSIONS = (".gz", ".zst")
STDLIB_MAX_CHARS = 20_000_000
STDLIB_FILES_PER_UNIT = 64
BINARY_SNIFF_BYTES = 8192  # a NUL byte this early means a binary file, not text
# Compressed bytes decompressed per step: a reader holds this times the compression ratio, and a corrupt file's
# offset is named to this precision.
FEED_BYTES = 1 << 14
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Unit:
    """One task of tokenization. kind: "stdlib" (files [start, stop) of the default corpus, whose root is path),
    "text" (a file, one document), "jsonl" (the lines starting in bytes [start, stop) of a plain file; a compressed
    file whole: stop -1), "parquet" (row groups [start, stop))."""

    kind: str
    path: str = ""
    start: int = 0
    stop: int = -1


@dataclass(frozen=True)
class ReadOptions:
    text_key: str = "text"  # jsonl field
    column: str = "text"  # parquet column
    encoding: str = "utf-8"  # .txt / .jsonl


def split_name(path: Path) -> tuple[str, str]:
    """(format, compression) of a file name: ("jsonl", ".zst") for x.jsonl.zst, ("txt", "") for x.md; ("", "") if
    not a corpus file."""
    compression = path.suffix if path.suffix in COMPRESSIONS else ""
    fmt = Path(path.stem).suffix if compression else path.suffix
    if fmt not in FORMATS or (fmt == ".parquet" and compression):
        return "", ""
    return "txt" if fmt in TEXT_FORMATS else fmt[1:], compression


def expand_inputs(inputs: list[str]) -> list[Path]:
    """The corpus files of `inputs` (files, or directories searched recursively), sorted within each directory.
    A directory's files in no corpus format are skipped: one line per extension says how many."""
    files = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file())
            files += [p for p in found if split_name(p)[0]]
            skipped = Counter(("".join(p.suffixes[-2:]) if p.suffix in COMPRESSIONS else p.suffix) or "no extension"
                              for p in found if not split_name(p)[0])
            for extension, count in sorted(skipped.items()):
                print(f"skipped {count} file{'s' if count > 1 else ''} ({extension}) in {path}: not "
                      f"{', '.join(FORMATS[:-1])} (each also .gz / .zst) or .parquet")
        elif path.is_file():
            if not split_name(path)[0]:
                raise UserError(f"{path} is not .txt, .md, .markdown, .rst, .jsonl or .parquet (all but parquet may "
                                "be .gz or .zst); convert it or pass a directory of those.")
            files.append(path)
        else:
            raise UserError(f"input {path} does not exist; pass existing files or directories with --input.")
    if not files:
        raise UserError(f"no .txt, .jsonl or .parquet files (nor Markdown or reStructuredText) in {inputs}; point "
                        "--input at your corpus.")
    return files


def plan_units(files: list[Path], chunk_bytes: int, options: ReadOptions) -> list[Unit]:
    """The units of `files` in corpus order. Parquet columns are checked here, before any work starts."""
    units = []
    for path in files:
        fmt, compression = split_name(path)
        if fmt == "txt":
            units.append(Unit("text", str(path)))
        elif fmt == "jsonl" and compression:
            units.append(Unit("jsonl", str(path)))  # a compressed stream cannot be entered mid-way
        elif fmt == "jsonl":
            size = path.stat().st_size
            units += [Unit("jsonl", str(path), a, min(a + chunk_bytes, size)) for a in range(0, size, chunk_bytes)]
        else:
            metadata = open_parquet(path, options.column).metadata
            first, size = 0, 0
            for group in range(metadata.num_row_groups):
                size += metadata.row_group(group).total_byte_size
                if size >= chunk_bytes or group == metadata.num_row_groups - 1:
                    units.append(Unit("parquet", str(path), first, group + 1))
                    first, size = group + 1, 0
    return units


def read_unit(unit: Unit, options: ReadOptions) -> Iterator[str]:
    """The documents of a unit in order; empty ones are skipped, except in the stdlib corpus (kept as they were)."""
    if unit.kind == "stdlib":
        yield from map(read_stdlib_file, stdlib_files()[unit.start : unit.stop])
        return
    path = Path(unit.path)
    if unit.kind == "text":
        with open_bytes(path) as f:
            data = f.read()
        refuse_binary(path, data)
        documents = iter([decode_text(data, path, options.encoding)])
    elif unit.kind == "jsonl":
        documents = read_jsonl(path, unit.start, unit.stop, options)
    else:
        parquet = open_parquet(path, options.column)
        # Batches of rows, not the unit's row groups at once (pyarrow holds about one row group's column).
        batches = parquet.iter_batches(PARQUET_BATCH_ROWS, row_groups=range(unit.start, unit.stop),
                                       columns=[options.column])
        documents = (doc for batch in batches for doc in batch.column(0).to_pylist())
    for doc in documents:
        if doc:
            yield doc


def stdlib_units(max_chars: int = STDLIB_MAX_CHARS) -> list[Unit]:
    """The bundled default corpus: this Python's standard library *.py files, sorted by path, one per document,
    up to max_chars characters (~20 MB of text; always present and offline), STDLIB_FILES_PER_UNIT per unit."""
    total = count = 0
    root = sysconfig.get_paths()["stdlib"]
    for path in stdlib_files():
        size = len(read_stdlib_file(path))
        if total + size > max_chars:
            break
        total, count = total + size, count + 1
    per_unit = STDLIB_FILES_PER_UNIT
    return [Unit("stdlib", root, a, min(a + per_unit, count)) for a in range(0, count, per_unit)]


@functools.cache  # once per process: every stdlib unit needs the list
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]  # installed, not stdlib
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_stdlib_file(path: Path) -> str:
    # A few stdlib test files are deliberately not UTF-8; replace rather than skip, for determinism.
    return path.read_bytes().decode("utf-8", errors="replace")


def open_parquet(path: Path, column: str) -> "pyarrow.parquet.ParquetFile":
    import pyarrow as pa  # here: a quarter-second import that corpora without parquet files never need
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if column not in parquet.schema_arrow.names:
        raise UserError(
            f"{path} has no column {column!r} (columns: {parquet.schema_arrow.names}); choose one with --column."
        )
    column_type = parquet.schema_arrow.field(column).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise UserError(f"{path}: column {column!r} holds {column_type}, not text; choose one with --column.")
    return parquet


def read_jsonl(path: Path, start: int, stop: int, options: ReadOptions) -> Iterator[str]:
    """The `text_key` string of every non-blank line that starts in bytes [start, stop) (stop -1: the whole
    file, which may be compressed); a bad line is reported as `file:line: reason`."""
    with open_bytes(path) as f:  # split on b"\n" only, so line numbers are an editor's line numbers
        first = 0
        if start == 0:
            refuse_binary(path, f.peek(BINARY_SNIFF_BYTES))
        else:
            f.seek(start - 1)
            f.readline()  # the line under way at `start` belongs to the unit before
            first = f.tell()
        position = first
        for i, raw in enumerate(f):
            if 0 <= stop <= position:
                return
            position += len(raw)
            try:
                text = parse_jsonl_line(raw, options)
            except ValueError as e:
                if path.suffix in COMPRESSIONS:  # data garbled by a corrupt stream is reported as that corruption
                    while f.read(1 << 20):
                        pass
                line_no = (1 if first == 0 else count_lines(path, first)) + i
                raise UserError(f"{path}:{line_no}: {e}") from None
            if text is not None:
                yield text


def parse_jsonl_line(raw: bytes, options: ReadOptions) -> str | None:
    """The document of one jsonl line, None for a blank line; ValueError with the reason for a bad one."""
    key = options.text_key
    line = decode_text(raw, None, options.encoding)
    if not line.strip():
        return None
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg}, column {e.colno}); each line must be one JSON object.") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object; each line must be an object like "
                         f'{{"{key}": "..."}}.')
    if key not in record:
        raise ValueError(f"no key {key!r} (keys: {sorted(record)}); choose one with --text-key.")
    if not isinstance(record[key], str):
        raise ValueError(f"{key!r} is a {type(record[key]).__name__}, not a string; choose the text field with "
                         "--text-key.")
    text = record[key]
    # JSON may escape half a UTF-16 pair (\ud800), which no tokenizer takes; isascii() is O(1), ASCII has none.
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{key!r} holds a lone surrogate (an unpaired \\u{ord(text[e.start]):04x} escape), "
                             "which is not text; fix or drop the line.") from None
    return text


def count_lines(path: Path, stop: int) -> int:
    """The (1-based) number of the line that starts at byte `stop` of a plain file; run only to report an error."""
    newlines = 0
    with path.open("rb") as f:
        while f.tell() < stop:
            newlines += f.read(min(1 << 20, stop - f.tell())).count(b"\n")
    return newlines + 1


def decode_text(data: bytes, path: Path | None, encoding: str) -> str:
    """`data` decoded strictly. A decoding error names the file and the line of the first bad byte; without a
    path (one jsonl line, placed by its caller) it is a ValueError with the reason only."""
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        reason = (f"not valid {encoding} (byte 0x{data[e.start]:02x}); convert the file to UTF-8, "
                  "or pass its real encoding, e.g. --encoding latin-1.")
        if path is None:
            raise ValueError(reason) from None
        line_no = 1 + data.count(b"\n", 0, e.start)
        raise UserError(f"{path}:{line_no}: {reason}") from None
    except LookupError:
        raise UserError(f"--encoding {encoding!r} is not an encoding Python knows; try utf-8 or latin-1.") from None


def refuse_binary(path: Path, head: bytes) -> None:
    if b"\0" in head[:BINARY_SNIFF_BYTES]:
        raise UserError(f"{path} looks binary (a NUL byte in its first {BINARY_SNIFF_BYTES} bytes), "
                        "not text; remove it from --input.")


def open_bytes(path: Path) -> io.BufferedReader:
    """A buffered binary reader of a file's content, decompressed if its name ends in .gz or .zst."""
    if path.suffix in COMPRESSIONS:
        return io.BufferedReader(Decompressed(path), buffer_size=1 << 18)
    return path.open("rb")


class Decompressed(io.RawIOBase):
    """The uncompressed bytes of a .gz or .zst file (several concatenated members or frames too), decompressed
    FEED_BYTES at a time so that corrupt or truncated data is a UserError naming the compressed offset."""

    def __init__(self, path: Path):
        self.path, self.format = path, "gzip" if path.suffix == ".gz" else "zstd"
        self.file = path.open("rb")
        self.offset = 0  # compressed bytes read
        self.pending = memoryview(b"")
        self.decompressor = None  # none between members or frames
        self.members = 0  # members or frames decoded whole

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        while not self.pending:
            feed = self.file.read(FEED_BYTES)
            if not feed:
                if self.decompressor is not None:
                    raise UserError(f"{self.path}: {self.format} data ends mid-stream at compressed byte "
                                    f"{self.offset} (truncated or corrupt); re-download or re-compress it.")
                return 0
            self.pending = memoryview(self._decompress(feed))
            self.offset += len(feed)
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n

    def _decompress(self, feed: bytes) -> bytes:
        out, size = [], len(feed)
        try:
            while feed:
                if self.decompressor is None:
                    # NULs after a member pad it to a block (tapes): skipped, as Python's gzip does; not before
                    # the first one, where they are no gzip file at all
                    if self.format == "gzip" and self.members:
                        feed = feed.lstrip(b"\0")
                        if not feed:
                            break
                    self.decompressor = (zlib.decompressobj(16 + zlib.MAX_WBITS) if self.format == "gzip"
                                         else zstandard.ZstdDecompressor().decompressobj())
                out.append(self.decompressor.decompress(feed))
                if not self.decompressor.eof:
                    break
                feed, self.decompressor = self.decompressor.unused_data, None  # the next member or frame
                self.members += 1
        except (zlib.error, zstandard.ZstdError) as e:
            raise UserError(f"{self.path}: corrupt {self.format} data in compressed bytes {self.offset}-"
                            f"{self.offset + size - 1} ({e}); re-download or re-compress it.") from None
        return b"".join(out)

    def close(self) -> None:
        self.file.close()
        super().close()
