"""Train a BPE tokenizer: sentencepiece (the default) or a Hugging Face byte-level BPE in DeepSeek-V3's layout.

    python scripts/train_tokenizer.py                                        # stdlib corpus → data/tokenizer.model
    python scripts/train_tokenizer.py --input corpus/ --vocab-size 32000 --out data/mine
    python scripts/train_tokenizer.py --kind hf-bpe --out data/mine-hf      # → data/mine-hf/tokenizer.json + config

Inputs are read exactly as scripts/prepare_data.py reads them (.txt / .jsonl / .parquet, directories), and both
kinds learn from the same prefix of the corpus, so training is deterministic and bounded.
sentencepiece: the settings keep text byte-exact through encode → decode (identity normalization, no dummy
prefix, whitespace kept, byte fallback), which code needs: indentation and newlines are tokens.
hf-bpe: byte-level BPE (every text encodes, byte-exact), BOS <｜begin▁of▁sentence｜> = 0 and EOS
<｜end▁of▁sentence｜> = 1 as in DeepSeek's tokenizer, and a tokenizer_config.json with add_bos_token true, so
dsv3 and transformers.AutoTokenizer both open OUT/ and put BOS before every document.
"""

import argparse
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file without installing dsv3
from dsv3.config import UserError, run_main  # noqa: E402
from scripts.prepare_data import iter_documents  # noqa: E402

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"  # DeepSeek-V3's, at its ids 0 and 1


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
    kind: str = "sentencepiece",
    encoding: str = "utf-8",
) -> Path:
    """Train on `inputs` (None or [] = the stdlib corpus); writes and returns OUT.model (sentencepiece) or the
    directory OUT/ holding tokenizer.json + tokenizer_config.json (hf-bpe)."""
    sentences = training_sentences(iter_documents(inputs, text_key, column, encoding), max_chars)
    if kind == "hf-bpe":
        return train_hf_bpe(sentences, Path(out), vocab_size)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
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
    staging = path.with_name(f"{path.name}.tmp-{os.getpid()}")  # a crash mid-write leaves the old model whole
    try:
        staging.write_bytes(model.getvalue())
        staging.replace(path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return path


def added_token(content: str) -> dict:
    """A special token as transformers writes it in tokenizer_config.json (DeepSeek's files have these)."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": False}


def train_hf_bpe(sentences: Iterator[str], out: Path, vocab_size: int) -> Path:
    """A byte-level BPE trained with the tokenizers library (on its own thread pool: RAYON_NUM_THREADS) into
    out/tokenizer.json + out/tokenizer_config.json, each written to a temporary name and renamed."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes, seen in the corpus or not
    if vocab_size <= len(alphabet) + 2:
        raise UserError(f"--vocab-size {vocab_size} leaves no room for merges; a byte-level BPE needs more than "
                        f"{len(alphabet) + 2} (256 bytes + BOS + EOS)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], initial_alphabet=alphabet, show_progress=False,
    ))
    # transformers' fast tokenizers add BOS through tokenizer.json's post-processor (version 5 ignores
    # add_bos_token when a tokenizer.json exists); dsv3 reads add_bos_token. Both say "BOS first".
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": added_token(BOS),
        "eos_token": added_token(EOS),
        "clean_up_tokenization_spaces": False,
        # DeepSeek names LlamaTokenizerFast, which transformers 5 builds as a Metaspace (sentencepiece-style)
        # tokenizer and swaps, with a warning, for a ByteLevel tokenizer.json; this class loads
        # tokenizer.json as it is, in transformers 4 and 5 alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    out.mkdir(parents=True, exist_ok=True)
    files = {"tokenizer.json": tokenizer.to_str(pretty=True),
             "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2)}
    for name, text in files.items():
        staging = out / f"{name}.tmp-{os.getpid()}"
        staging.write_text(text + "\n", encoding="utf-8")
        staging.replace(out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="*", default=None, help="files or directories; default: the stdlib corpus")
    parser.add_argument("--kind", choices=("sentencepiece", "hf-bpe"), default="sentencepiece",
                        help="sentencepiece: OUT.model; hf-bpe: OUT/tokenizer.json + OUT/tokenizer_config.json")
    parser.add_argument("--out", default="data/tokenizer", help="writes OUT.model, or OUT/ with --kind hf-bpe")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-chars", type=int, default=10_000_000, help="train on this prefix of the corpus")
    parser.add_argument("--text-key", default="text", help="jsonl field holding the document")
    parser.add_argument("--column", default="text", help="parquet column holding the document")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="sentencepiece only; hf-bpe trains on all cores, or RAYON_NUM_THREADS")
    parser.add_argument("--encoding", default="utf-8", help=".txt/.jsonl text encoding, e.g. latin-1")
    args = parser.parse_args()
    path = train_tokenizer(
        args.input, args.out, args.vocab_size, args.max_chars, args.text_key, args.column, args.threads, args.kind,
        args.encoding,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
