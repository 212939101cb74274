"""Train the sentencepiece BPE tokenizer.

    python scripts/train_tokenizer.py                                        # stdlib corpus → data/tokenizer.model
    python scripts/train_tokenizer.py --input corpus/ --vocab-size 32000 --out data/mine

Inputs are read exactly as scripts/prepare_data.py reads them (.txt / .jsonl / .parquet, directories).
The settings keep text byte-exact through encode → decode (identity normalization, no dummy prefix,
whitespace kept, byte fallback), which code needs: indentation and newlines are tokens.
"""

import argparse
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file without installing dsv3
from dsv3.config import run_main  # noqa: E402
from scripts.prepare_data import iter_documents  # noqa: E402


def training_sentences(documents: Iterator[str], max_chars: int, chunk_chars: int = 2000) -> Iterator[str]:
    """The first max_chars characters of the corpus as chunks of whole lines, newlines included.

    sentencepiece learns from "sentences"; chunks of several lines let it learn newline + indentation
    pieces, and a prefix of the corpus (not a random sample) keeps training deterministic and bounded.
    """
    total = 0
    for doc in documents:
        chunk = ""
        for line in doc.splitlines(keepends=True):
            if chunk and len(chunk) + len(line) > chunk_chars:
                yield chunk
                total += len(chunk)
                chunk = ""
            chunk += line
        if chunk:
            yield chunk
            total += len(chunk)
        if total >= max_chars:
            return


def train_tokenizer(
    inputs: list[str] | None,
    out: str = "data/tokenizer",
    vocab_size: int = 4096,
    max_chars: int = 10_000_000,
    text_key: str = "text",
    column: str = "text",
    num_threads: int = 2,
) -> Path:
    """Train on `inputs` (None or [] = the stdlib corpus); writes and returns OUT.model."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=training_sentences(iter_documents(inputs, text_key, column), max_chars),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,  # any text encodes; unseen characters become UTF-8 byte pieces
        character_coverage=0.9999,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_by_whitespace=False,  # lets BPE merge indentation runs and "):\n"-style code pieces
        allow_whitespace_only_pieces=True,
        split_digits=True,
        max_sentence_length=16384,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=num_threads,
        minloglevel=2,
    )
    path = Path(out + ".model")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="*", default=None, help="files or directories; default: the stdlib corpus")
    parser.add_argument("--out", default="data/tokenizer", help="writes OUT.model")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-chars", type=int, default=10_000_000, help="train on this prefix of the corpus")
    parser.add_argument("--text-key", default="text", help="jsonl field holding the document")
    parser.add_argument("--column", default="text", help="parquet column holding the document")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    path = train_tokenizer(
        args.input, args.out, args.vocab_size, args.max_chars, args.text_key, args.column, args.threads
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
