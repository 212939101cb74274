"""Time scripts/prepare_data.py at several worker counts on a synthetic corpus built on the spot (no download).

    python scripts/bench_prepare.py                                        # 256 MB of .jsonl.zst, workers 1 4 16
    python scripts/bench_prepare.py --mb 8 --hf-mb 4 --files 16 --workers 1 2   # a quick check

The corpus is copies of this Python's standard library sources, each copy with a quarter of its identifiers
renamed and its files shuffled, so that every copy is new text to BPE and its caches, written as --files
.jsonl.zst files (one document per source file). sentencepiece (data/tokenizer.model) tokenizes all of it; a
byte-level BPE trained here like `train_tokenizer.py --kind hf-bpe` encodes slower per core, so it takes
the first --hf-mb only. Every run is a fresh `python scripts/prepare_data.py` process timed from start to exit,
and the datasets of all worker counts must be byte-identical. Prints a markdown table.
"""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file without installing dsv3
from dsv3.corpus import read_stdlib_file, stdlib_files  # noqa: E402
from scripts.train_tokenizer import train_hf_bpe, training_sentences  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IDENTIFIER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)")
RENAMED_SHARE = 0.25


def build_corpus(directory: Path, megabytes: float, n_files: int) -> list[Path]:
    """n_files .jsonl.zst files holding `megabytes` MB of text; returns them in name order."""
    sources = [read_stdlib_file(path) for path in stdlib_files()]
    pieces = [IDENTIFIER.split(text) for text in sources]  # odd places hold identifiers
    identifiers = sorted({name for parts in pieces for name in parts[1::2]})
    per_file, total, copy = megabytes * 1e6 / n_files, 0, 0
    files, writer = [], None
    while total < megabytes * 1e6:
        rng = random.Random(copy)
        renamed = {name: f"{name}_{rng.choice('bcdfghjklmnpqrstvwxz')}{rng.choice('aeiou')}{rng.randrange(100)}"
                   for name in identifiers if rng.random() < RENAMED_SHARE}
        order = list(range(len(sources)))
        rng.shuffle(order)
        for i in order:
            if len(files) <= min(total // per_file, n_files - 1):  # this document starts the next file
                if writer is not None:
                    writer.close()
                files.append(directory / f"part_{len(files):05d}.jsonl.zst")
                writer = zstandard.ZstdCompressor().stream_writer(files[-1].open("wb"))
            text = "".join([renamed.get(part, part) for part in pieces[i]])
            writer.write((json.dumps({"text": text}) + "\n").encode())
            total += len(text)
            if total >= megabytes * 1e6:
                break
        copy += 1
    writer.close()
    return files


def dataset_digest(out: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(out)).encode())
        with path.open("rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def time_prepare(inputs: list[str], tokenizer: str, out: Path, workers: int) -> tuple[float, int, str]:
    """(seconds, tokens, digest of the dataset) of one prepare_data.py process; the dataset is removed."""
    command = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--input", *inputs,
               "--tokenizer", tokenizer, "--out", str(out), "--workers", str(workers)]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode:
        sys.exit(f"prepare_data.py failed:\n{result.stderr}")
    tokens = sum(json.loads((out / split / "index.json").read_text())["num_tokens"] for split in ("train", "val"))
    digest = dataset_digest(out)
    shutil.rmtree(out)
    return seconds, tokens, digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=256, help="MB of text in the corpus (sentencepiece's share)")
    parser.add_argument("--hf-mb", type=float, default=96, help="MB of it the HF byte-level BPE tokenizes")
    parser.add_argument("--files", type=int, default=512, help=".jsonl.zst files (each one unit of work)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--hf-vocab", type=int, default=32768)
    parser.add_argument("--dir", default=None, help="work directory (default: a new temporary one, removed)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_prepare_"))
    (work / "corpus").mkdir(parents=True)
    start = time.perf_counter()
    files = build_corpus(work / "corpus", args.mb, args.files)
    hf_files = files[: max(1, round(len(files) * args.hf_mb / args.mb))]
    built = time.perf_counter() - start
    start = time.perf_counter()
    sample = training_sentences((read_stdlib_file(p) for p in stdlib_files()), 5_000_000)
    hf_tokenizer = train_hf_bpe(sample, work / "hf_tokenizer", args.hf_vocab)
    print(f"{os.cpu_count()} CPUs; corpus: {args.mb:g} MB of text in {len(files)} .jsonl.zst files "
          f"({sum(f.stat().st_size for f in files) / 1e6:.0f} MB) built in {built:.0f} s; HF BPE (vocab "
          f"{args.hf_vocab}) trained in {time.perf_counter() - start:.0f} s on {len(hf_files)} files", flush=True)
    runs = {"sentencepiece (data/tokenizer.model)": ([str(work / "corpus")], str(ROOT / "data" / "tokenizer.model")),
            f"HF byte-level BPE {args.hf_vocab}": ([str(f) for f in hf_files], str(hf_tokenizer))}
    rows, identical = [], True
    for name, (inputs, tokenizer) in runs.items():
        results = {}
        for workers in args.workers:
            results[workers] = time_prepare(inputs, tokenizer, work / "out", workers)
            print(f"{name}, {workers} workers: {results[workers][0]:.1f} s", flush=True)
        base = results[args.workers[0]][0]
        for workers, (seconds, tokens, _) in results.items():
            rows.append(f"| {name} | {workers} | {tokens:,} | {seconds:.1f} | {tokens / seconds / 1e6:.2f}M | "
                        f"{base / seconds:.1f}× |")
        identical &= len({digest for _, _, digest in results.values()}) == 1
    if not args.dir:
        shutil.rmtree(work)
    print(f"\n| tokenizer | workers | tokens | seconds | tokens/s | speed-up vs {args.workers[0]} worker(s) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\ndatasets byte-identical across worker counts: {'yes' if identical else 'NO'}")
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
