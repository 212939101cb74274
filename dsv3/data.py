"""The packed-sequence loader over token shards written by scripts/prepare_data.py.

On disk, `DIR/{train,val}/` holds `shard_NNNNN.bin` (raw uint16/uint32 token ids, documents separated
by EOS) and an `index.json` naming the shards in order with their token counts. The loader sees the
shards as one stream of N tokens cut into (N - 1) // seq_len sequences of seq_len + 1 tokens.
"""

import json
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from dsv3.config import UserError
from dsv3.safeopen import refuse_link
from dsv3.tokenizer import Tokenizer, find_tokenizer

_INDEX_KEYS = {"dtype": str, "vocab_size": int, "eos_id": int, "shards": list}


def read_index(split_dir: str | Path) -> dict:
    """A split's index.json, checked: valid JSON holding the keys the loader reads, of their types, and shards that
    name files inside the split (no absolute path, no `..`)."""
    index_path = Path(split_dir) / "index.json"
    if not index_path.is_file():
        raise UserError(
            f"no token shards at {index_path}; write them with "
            f"`python scripts/prepare_data.py --input YOUR_CORPUS --out {Path(split_dir).parent}`"
        )
    fix = f"re-run scripts/prepare_data.py for {Path(split_dir).parent}"
    try:
        index = json.loads(index_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{index_path} is not valid JSON ({e}): it is truncated or damaged; {fix}") from None
    if not isinstance(index, dict):
        raise UserError(f"{index_path} holds a {type(index).__name__}, not an index; {fix}")
    for key, kind in _INDEX_KEYS.items():
        if not isinstance(index.get(key), kind) or isinstance(index.get(key), bool):
            found = "no" if key not in index else f"a {type(index[key]).__name__} as"
            raise UserError(f"{index_path} has {found} {key!r} (a {kind.__name__} is expected); {fix}")
    try:
        np.dtype(index["dtype"])
    except TypeError:
        raise UserError(f"{index_path} names dtype {index['dtype']!r}, no numpy dtype; {fix}") from None
    for shard in index["shards"]:
        if (not isinstance(shard, dict) or not isinstance(shard.get("file"), str)
                or not isinstance(shard.get("tokens"), int) or shard["tokens"] < 0):
            raise UserError(f"{index_path} has a shard entry {shard!r}, not {{\"file\": NAME, \"tokens\": COUNT}}; "
                            f"{fix}")
        name = Path(shard["file"])
        if name.is_absolute() or ".." in name.parts or not name.parts:
            raise UserError(f"{index_path} names shard {shard['file']!r}, outside {split_dir}: a dataset reads only "
                            f"its own files; {fix}")
    return index


def fingerprint(index: dict) -> str | None:
    """The dataset's content as index.json records it: each shard's name, token count and crc32 (prepare_data.py
    writes them); None for a dataset prepared before shards carried a checksum."""
    if not index["shards"] or not all("crc32" in shard for shard in index["shards"]):
        return None
    listing = json.dumps([[s["file"], s["tokens"], s["crc32"]] for s in index["shards"]])
    return f"{zlib.crc32(listing.encode()):08x}-{sum(s['tokens'] for s in index['shards'])}"


def check_sources(mixture: list[tuple[str, str, float]], model_vocab_size: int, init_from: str = "") -> None:
    """Refuse, before anything is built, datasets that cannot be mixed or trained on: a missing one, sources
    tokenized differently, data tokenized unlike the weights it starts from, a vocabulary the model cannot embed."""
    indexes = {name: read_index(Path(path) / "train") for name, path, _ in mixture}
    fingerprints = {name: index["tokenizer_fingerprint"] for name, index in indexes.items()
                    if "tokenizer_fingerprint" in index}  # datasets prepared before fingerprints carry none
    if len(set(fingerprints.values())) > 1:
        listing = ", ".join(f"{name} {fingerprint[:12]}" for name, fingerprint in fingerprints.items())
        raise UserError(f"the data sources were prepared with different tokenizers ({listing}): prepare them "
                        "all with the same scripts/prepare_data.py --tokenizer")
    weights_tokenizer = find_tokenizer(init_from) if init_from else None
    if weights_tokenizer is not None:
        for name, fingerprint in fingerprints.items():
            if fingerprint != weights_tokenizer.fingerprint:
                raise UserError(f"data source {name} was prepared with another tokenizer than the one "
                                f"checkpoint.init_from={init_from} carries: re-run scripts/prepare_data.py "
                                f"--tokenizer {init_from}")
    for name, index in indexes.items():
        if index["vocab_size"] > model_vocab_size:
            raise UserError(f"the data's tokenizer ({name}) has {index['vocab_size']} tokens but model.vocab_size "
                            f"is {model_vocab_size}: set --model.vocab_size={index['vocab_size']} or re-tokenize "
                            "the data")


def _check_shards(split_dir: Path, index: dict) -> None:
    """Every shard holds the tokens index.json says: a truncated or swapped shard, or an index that lies, stops here
    naming the file (as a numpy error later, or a silently shorter stream)."""
    itemsize = np.dtype(index["dtype"]).itemsize
    for shard in index["shards"]:
        file = split_dir / shard["file"]
        refuse_link(file)  # a link would read whatever it points at
        size = file.stat().st_size if file.is_file() else None
        if size != shard["tokens"] * itemsize:
            found = "is missing" if size is None else f"has {size} bytes"
            raise UserError(f"{file} {found}, but {split_dir / 'index.json'} says {shard['tokens']} {index['dtype']} "
                            f"tokens ({shard['tokens'] * itemsize} bytes): re-run scripts/prepare_data.py for "
                            f"{split_dir.parent}")


def check_first_batch(loader: "MixtureLoader", global_batch: int, vocab_size: int) -> None:
    """Each source's next `global_batch` sequences hold ids below model.vocab_size: shards of another tokenizer
    than their index.json names stop here, not as an embedding IndexError naming no file."""
    for name, source in loader.loaders.items():
        first = source.sequences_consumed
        largest = int(source.rows(np.arange(first, first + global_batch)).max())
        if largest >= vocab_size:
            raise UserError(f"data source {name} ({loader.paths[name]}) holds token id {largest}, but model.vocab_size "
                            f"is {vocab_size}: its shards do not match its index.json; re-run scripts/prepare_data.py")


def host_memory_available() -> int:
    """Bytes the host can still give (MemAvailable), or the physical memory where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(global_batch: int, micro_batch: int, seq_len: int, world: int, vocab_size: int, dim: int,
                      n_layers: int) -> None:
    """On CPU, refuse before anything is allocated a batch the host cannot hold, which the OOM killer would end with
    no word. A lower bound: this rank's rows of the global batch (int64, in numpy and a tensor) and a micro-batch's
    fp32 logits (three copies: logits, softmax, gradient) and ~20 fp32 tensors of width dim per layer."""
    rows = global_batch // max(world, 1) * (seq_len + 1) * 8 * 2
    activations = micro_batch * seq_len * 4 * (3 * vocab_size + 20 * dim * n_layers)
    available = host_memory_available()
    if rows + activations > available:
        raise UserError(f"train.global_batch={global_batch} and train.micro_batch={micro_batch} at seq_len {seq_len} "
                        f"need at least {(rows + activations) / 2**30:,.1f} GiB of host memory per rank "
                        f"({rows / 2**30:,.1f} GiB of batch, {activations / 2**30:,.1f} GiB of activations), but "
                        f"{available / 2**30:,.1f} GiB are available: lower --train.micro_batch and "
                        "--train.global_batch")


_FEISTEL_ROUNDS = 6


def shuffled_index(index: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """π(index) for a pseudo-random permutation π of [0, n) chosen by (seed, epoch), in O(len(index)) time and memory
    whatever n is, since a 14.8T-token corpus holds ~3.6e9 sequences: a balanced Feistel network over 2k-bit
    integers, 2^2k ≥ n, restricted to [0, n) by cycle-walking (docs/data.md#layout)."""
    half_bits = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    entropy = [seed % 2**64, epoch]  # SeedSequence takes no negative seed
    keys = np.random.SeedSequence(entropy).generate_state(_FEISTEL_ROUNDS, dtype=np.uint64)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << shift) | right

    out = encrypt(np.asarray(index, dtype=np.uint64))
    while (outside := out >= n).any():
        out[outside] = encrypt(out[outside])
    return out.astype(np.int64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches every output bit (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _local_rows(global_batch: int, world_size: int) -> int:
    if global_batch % world_size:
        raise ValueError(f"global_batch {global_batch} is not divisible by world_size {world_size}")
    return global_batch // world_size


class PackedLoader:
    """Fixed-length sequences from the packed token stream, in a seeded global order. The position
    (`sequences_consumed`) counts sequences of the global order, so a state saved at one world size resumes at
    another with the same global batches; each rank takes its contiguous rows."""

    def __init__(
        self,
        data_dir: str,
        split: str,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        index = read_index(Path(data_dir) / split)
        split_dir = Path(data_dir) / split
        self.seq_len, self.rank, self.world_size = seq_len, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.split_dir = split_dir
        self.fingerprint = fingerprint(index)
        self.vocab_size: int = index["vocab_size"]
        self.eos_id: int = index["eos_id"]
        _check_shards(split_dir, index)
        # memmap only: shards can be far larger than RAM.
        self.shards = [
            np.memmap(split_dir / s["file"], dtype=index["dtype"], mode="r", shape=(s["tokens"],))
            for s in index["shards"]
            if s["tokens"] > 0
        ]
        self.shard_starts = np.cumsum([0] + [len(s) for s in self.shards])  # [n_shards + 1]
        n_tokens = int(self.shard_starts[-1])
        self.num_sequences = (n_tokens - 1) // seq_len
        if self.num_sequences < 1:
            raise UserError(
                f"{split_dir} has {n_tokens} tokens, fewer than one sequence of seq_len + 1 = "
                f"{seq_len + 1}; use a shorter seq_len or more data"
                + (", or train without validation: --train.val_every=0" if split_dir.name == "val" else "")
            )
        self.sequences_consumed = 0

    def _order_for(self, epoch: int, index: np.ndarray) -> np.ndarray:
        """The sequences at places `index` of epoch `epoch`'s order."""
        if not self.shuffle:
            return index
        return shuffled_index(index, self.num_sequences, self.seed, epoch)

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream, stitched across shard boundaries."""
        first = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            offset = start - int(self.shard_starts[first])
            take = min(stop - start, len(self.shards[first]) - offset)
            pieces.append(self.shards[first][offset : offset + take])
            start += take
            first += 1
        return np.concatenate(pieces)

    def rows(self, places: np.ndarray) -> np.ndarray:
        """The sequences at places `places` of the global order (places past the end run into later epochs).
        [len(places), seq_len + 1]"""
        epochs, index = np.divmod(np.asarray(places, dtype=np.int64), self.num_sequences)
        sequences = np.empty_like(index)
        for epoch in np.unique(epochs):  # a batch can straddle epochs
            in_epoch = epochs == epoch
            sequences[in_epoch] = self._order_for(int(epoch), index[in_epoch])
        rows = [self._tokens(seq * self.seq_len, seq * self.seq_len + self.seq_len + 1) for seq in sequences.tolist()]
        if not rows:
            return np.empty((0, self.seq_len + 1), np.int64)
        batch = np.stack(rows)
        if int(batch.max()) >= self.vocab_size:  # one pass over a batch's ids: cheap beside a step
            raise UserError(f"{self.split_dir} holds token id {int(batch.max())} (in sequence "
                            f"{int(sequences[int(batch.max(axis=1).argmax())])}), but its index.json says "
                            f"vocab_size {self.vocab_size}: its shards do not match their index; re-run "
                            "scripts/prepare_data.py")
        return batch.astype(np.int64)

    def next_batch(self, global_batch: int) -> torch.Tensor:
        """Next `global_batch` sequences of the global order; this rank's rows. [global_batch // world, seq_len + 1]"""
        local = _local_rows(global_batch, self.world_size)
        first = self.sequences_consumed + self.rank * local
        self.sequences_consumed += global_batch
        return torch.from_numpy(self.rows(np.arange(first, first + local)))

    def state_dict(self) -> dict:
        state = {
            "sequences_consumed": self.sequences_consumed,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_sequences": self.num_sequences,
        }
        if self.fingerprint is not None:
            state["fingerprint"] = self.fingerprint
        return state

    def load_state_dict(self, state: dict) -> None:
        # A different seq_len or dataset would silently replay other data; refuse instead.
        for key in ("seq_len", "num_sequences"):
            if key in state and int(state[key]) != getattr(self, key):
                raise UserError(
                    f"loader state has {key}={int(state[key])} but this loader has "
                    f"{getattr(self, key)}; resume with the same data and seq_len"
                )
        saved = state.get("fingerprint")
        if saved is not None and self.fingerprint is not None and saved != self.fingerprint:  # either may predate them
            raise UserError(f"{self.split_dir} holds other tokens than the run was trained on (dataset fingerprint "
                            f"{self.fingerprint}, the checkpoint's {state['fingerprint']}): it was prepared again. "
                            "Resume with the dataset the run started on, or start a new run on this one")
        self.sequences_consumed = int(state["sequences_consumed"])
        self.seed = int(state["seed"])


# Position i of the mixed order draws the source whose share of [0, 2^64) holds i·2^64/φ mod 2^64: a Weyl
# sequence, so every prefix of the order gives each source its share to within O(log n) sequences, and the
# source of a position needs nothing but the position.
_WEYL_STEP = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / φ, odd


class MixtureLoader:
    """Sequences from several token datasets mixed by weight, in one seeded global order that is the same at every
    world size: the mixture picks the source of each place, each source a PackedLoader with its own position and
    epochs. A single dataset is a mixture of one and reads exactly as its PackedLoader would."""

    def __init__(self, sources: list[tuple[str, str, float]], split: str, seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.rank, self.world_size, self.seq_len = rank, world_size, seq_len
        self.shares = {name: share for name, _, share in sources}
        self.paths = {name: path for name, path, _ in sources}
        self.loaders = {name: PackedLoader(path, split, seq_len, seed=seed + i, shuffle=shuffle)
                        for i, (name, path, _) in enumerate(sources)}
        # source k takes the points in [upper[k-1], upper[k]) of [0, 2^64)
        cumulative = np.cumsum([share for _, _, share in sources])[:-1]
        self.upper = np.array([min(int(c * 2.0**64), 2**64 - 1) for c in cumulative], dtype=np.uint64)
        self.sequences_consumed = 0

    def source_of(self, places: np.ndarray) -> np.ndarray:
        """Index of the source that fills each place of the mixed order."""
        with np.errstate(over="ignore"):  # the product wraps mod 2^64 on purpose
            points = np.asarray(places, dtype=np.uint64) * _WEYL_STEP
        return np.searchsorted(self.upper, points, side="right")

    def next_batch(self, global_batch: int) -> torch.Tensor:
        """Next `global_batch` sequences of the mixed order; this rank's rows. [global_batch // world, seq_len + 1]"""
        local = _local_rows(global_batch, self.world_size)
        source = self.source_of(np.arange(self.sequences_consumed, self.sequences_consumed + global_batch))
        place_in_source = np.empty(global_batch, dtype=np.int64)  # each source's own global order
        for k, loader in enumerate(self.loaders.values()):
            mine = source == k
            place_in_source[mine] = loader.sequences_consumed + np.arange(int(mine.sum()))
            loader.sequences_consumed += int(mine.sum())
        self.sequences_consumed += global_batch
        rows = slice(self.rank * local, (self.rank + 1) * local)
        batch = np.empty((local, self.seq_len + 1), dtype=np.int64)
        for k, loader in enumerate(self.loaders.values()):
            mine = source[rows] == k
            batch[mine] = loader.rows(place_in_source[rows][mine])
        return torch.from_numpy(batch)

    def tokens_seen(self) -> dict[str, int]:
        """Training tokens (targets) drawn from each source so far."""
        return {name: loader.sequences_consumed * self.seq_len for name, loader in self.loaders.items()}

    def state_dict(self) -> dict:
        return {"sequences_consumed": self.sequences_consumed,
                "sources": {name: loader.state_dict() for name, loader in self.loaders.items()}}

    def load_state_dict(self, state: dict) -> None:
        if set(state["sources"]) != set(self.loaders):
            raise UserError(f"the checkpoint read the sources {sorted(state['sources'])} but this run has "
                            f"{sorted(self.loaders)}; resume with the same data.sources")
        self.sequences_consumed = int(state["sequences_consumed"])
        for name, loader in self.loaders.items():
            loader.load_state_dict(state["sources"][name])


def describe_mixture(loader: MixtureLoader, run_sequences: int) -> str:
    """Each source's share, size and the epochs this run will take of it (`run_sequences`: the run's total)."""
    parts = []
    for name, source in loader.loaders.items():
        size = source.num_sequences * source.seq_len
        epochs = loader.shares[name] * run_sequences / source.num_sequences
        parts.append(f"{name} {100 * loader.shares[name]:.3g}% ({loader.paths[name]}: {size / 1e6:,.4g}M tokens, "
                     f"{epochs:.2g} epochs in this run)")
    return "; ".join(parts)


def data_tokenizer(mixture: list[tuple[str, str, float]]) -> Tokenizer | None:
    """The tokenizer the data was prepared with (saved in the dataset by scripts/prepare_data.py), if any."""
    directory = Path(mixture[0][1]) / "tokenizer"
    try:
        return find_tokenizer(directory)
    except UserError as e:
        raise UserError(f"the dataset's tokenizer in {directory} does not open ({e}); restore it, or re-run "
                        "scripts/prepare_data.py for the dataset") from None
