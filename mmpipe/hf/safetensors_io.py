"""safetensors in and out one tensor at a time: a directory's weights (one file, or sharded with
model.safetensors.index.json) read lazily, and a sharded directory (or one file) written as the tensors come.

Why: reading every shard into one dict holds the whole checkpoint; at 72B (144 GB of bf16) no node has that.
`LazyWeights` reads only the headers up front (names, shapes, dtypes: a few KB per shard) and a tensor when it
is asked for (safe_open, opened for that tensor and closed again, so no shard's pages stay mapped), or only some
rows of it (`read_rows`: plain reads of those rows' bytes into memory of their own, no page of the file mapped;
what a tensor-parallel import reads, each TP rank's slice of each split tensor, mmpipe.hf.stream.Imported.save).
`write_sharded` writes each shard's header first, from the tensors' shapes and dtypes planned up front, then
the tensors' bytes in order as they are handed over: it holds no tensor itself, so an export's peak is the
one layer it is copying, whatever the shard size.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default (max_shard_size)
# torch dtype <-> safetensors header dtype
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
BY_NAME = {v: k for k, v in DTYPES.items()}


class LazyWeights(Mapping):
    """name -> tensor over safetensors files, each tensor read when asked for (module docstring).
    shape(name), dtype(name), nbytes(name) read the header only. `loaded` (a callback, None by default) is
    told of every tensor (or slice, rows) read: tests count live tensor bytes with it."""

    loaded = None  # a callback(name, tensor); class-level so a test can watch every LazyWeights an import opens

    def __init__(self, files: Mapping[str, Path]):
        self.files, self.meta, self._starts = dict(files), {}, {}
        for f in dict.fromkeys(self.files.values()):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    self.meta[k] = (tuple(sl.get_shape()), BY_NAME[sl.get_dtype()])

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(name)
        with safe_open(str(self.files[name]), "pt") as h:
            t = h.get_tensor(name)
        if self.loaded is not None:
            self.loaded(name, t)
        return t

    def rows(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Rows [lo, hi) of each range along dim, concatenated, read from the file without the rest of the tensor:
        a TP rank's slice of a [V, D] embedding is V / TP rows. Read with plain reads into the slice's own memory
        (one read a range along dim 0; one per leading index along a later dim: a column slice of a [D, F] weight is
        D reads of hi - lo columns), so no page of the file is mapped: safetensors' get_slice gives a view into the
        file's mapping whose storage is the whole tensor (torch.save of it wrote all V rows into each rank's file),
        and copying out of the mapping held the slice twice (its mapped pages and the copy: measured, TP 2's import
        peaked at 132 MiB against TP 1's 126 MiB for a 125 MiB embedding)."""
        if name not in self.files:
            raise KeyError(name)
        shape, dtype = self.meta[name]
        start = self._start(name)
        inner = math.prod(shape[dim + 1:]) * dtype.itemsize  # bytes of one index along dim
        pieces = []
        with open(self.files[name], "rb", buffering=0) as f:
            for lo, hi in ranges:
                outer, width = math.prod(shape[:dim]), (hi - lo) * inner
                buf = torch.empty(outer * width, dtype=torch.uint8)
                view = memoryview(buf.numpy())
                for o in range(outer):  # the o-th leading index's rows lo..hi: contiguous in the file
                    f.seek(start + (o * shape[dim] + lo) * inner)
                    if f.readinto(view[o * width:(o + 1) * width]) != width:
                        raise OSError(f"{self.files[name]}: '{name}' ends before its header says")
                pieces.append(buf.view(dtype).reshape(*shape[:dim], hi - lo, *shape[dim + 1:]))
        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
        if self.loaded is not None:
            self.loaded(name, t)
        return t

    def _start(self, name: str) -> int:
        """The file offset of the tensor's first byte: 8 + the header's length + its data_offsets[0] (the format:
        a little-endian u64 header length, the JSON header, the data), each file's header parsed once."""
        f = self.files[name]
        if f not in self._starts:
            with open(f, "rb") as h:
                n = struct.unpack("<Q", h.read(8))[0]
                head = json.loads(h.read(n))
            self._starts[f] = {k: 8 + n + v["data_offsets"][0] for k, v in head.items() if k != "__metadata__"}
        return self._starts[f][name]

    def __contains__(self, name) -> bool:  # Mapping's own reads the tensor (self[name]) to answer
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[name][1]

    def nbytes(self, name: str) -> int:
        return math.prod(self.shape(name)) * self.dtype(name).itemsize


class InMemory(dict):
    """A dict of tensors with LazyWeights' header readers: what the importers take either way."""

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self[name].dtype


def read_rows(source, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Rows [lo, hi) of each range along dim of source[name], concatenated: a source that reads slices (LazyWeights
    and the views over one: `rows`) reads only them; any other mapping reads the tensor and keeps a copy of the rows
    (the whole tensor is dropped on return)."""
    if hasattr(source, "rows"):
        return source.rows(name, dim, ranges)
    t = source[name]
    return torch.cat([t.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim).clone()


def same_tensor(source, a: str, b: str, blocks: int = 16) -> bool:
    """source[a] equals source[b] (a tied head and its embedding), compared in `blocks` row blocks read one pair at
    a time (read_rows): 2 / blocks of the tensor in memory, where reading both whole held two embeddings
    (Qwen2.5-VL-72B's: 2 x 2.49 GB of bf16, more than a TP rank's share of any layer)."""
    shape = tuple(source.shape(a))
    if shape != tuple(source.shape(b)) or source.dtype(a) != source.dtype(b):
        return False
    if not shape:
        return torch.equal(source[a], source[b])
    step = max(1, -(-shape[0] // blocks))
    pieces = [[(lo, min(lo + step, shape[0]))] for lo in range(0, shape[0], step)]
    return all(torch.equal(read_rows(source, a, 0, r), read_rows(source, b, 0, r)) for r in pieces)


def as_weights(source) -> Mapping:
    """A LazyWeights as it is, a plain dict wrapped (InMemory)."""
    return source if hasattr(source, "shape") and hasattr(source, "dtype") else InMemory(source)


class Renamed(Mapping):
    """A weights view under other names (rename: old name -> new name), still read lazily."""

    def __init__(self, source, rename):
        self.source = as_weights(source)
        self.names = {rename(k): k for k in self.source}

    def __getitem__(self, name):
        return self.source[self.names[name]]

    def rows(self, name, dim, ranges):
        return read_rows(self.source, self.names[name], dim, ranges)

    def __contains__(self, name):
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def shape(self, name):
        return self.source.shape(self.names[name])

    def dtype(self, name):
        return self.source.dtype(self.names[name])


class Joined(Mapping):
    """Several weights mappings as one (their names must not overlap), still read lazily."""

    def __init__(self, *parts):
        self.of = {k: p for p in map(as_weights, parts) for k in p}

    def __getitem__(self, name):
        return self.of[name][name]

    def rows(self, name, dim, ranges):
        return read_rows(self.of[name], name, dim, ranges)

    def __contains__(self, name):
        return name in self.of

    def __iter__(self):
        return iter(self.of)

    def __len__(self):
        return len(self.of)

    def shape(self, name):
        return self.of[name].shape(name)

    def dtype(self, name):
        return self.of[name].dtype(name)


def open_weights(path: str | Path) -> LazyWeights:
    """A directory's safetensors weights, lazily: the index's shards, or model.safetensors. A shard the index
    names that is missing is one line naming it."""
    path = Path(path)
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{index}: not a safetensors index ({e!r})") from None
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise ConfigError(f"{path}: the index names shard {shard}, which is missing")
        return LazyWeights({k: path / s for k, s in weight_map.items()})
    if (path / SINGLE).is_file():
        return open_file(path / SINGLE)
    raise ConfigError(f"{path}: no {SINGLE} or {INDEX} (only safetensors weights are read)")


def open_file(path: str | Path) -> LazyWeights:
    """One .safetensors file, lazily."""
    with safe_open(str(path), "pt") as h:
        names = list(h.keys())
    return LazyWeights({k: Path(path) for k in names})


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory in memory (small models, tests); the importers read lazily (open_weights)."""
    lazy = open_weights(path)
    return {k: lazy[k] for k in lazy}


def parse_size(size: str | int) -> int:
    """'5GB' -> 5_000_000_000, '500MB', '2GiB', or bytes; transformers' reading of max_shard_size."""
    from transformers.utils.hub import convert_file_size_to_int
    try:
        n = convert_file_size_to_int(size if not str(size).isdigit() else int(size))
    except ValueError:
        raise ConfigError(f"--shard-size: '{size}' is not a size (e.g. 5GB, 500MB, 2GiB)") from None
    if n <= 0:
        raise ConfigError(f"--shard-size: {size} is not a positive size")
    return n


def plan_shards(entries: list[tuple[str, torch.dtype, tuple]], max_bytes: int) -> list[list[int]]:
    """entries (name, dtype, shape), in writing order -> shards, each a list of entry positions: a new shard
    when the next tensor would take the current one past max_bytes (transformers' rule: a tensor larger than
    max_bytes gets a shard of its own)."""
    shards, size = [[]], 0
    for i, (_, dtype, shape) in enumerate(entries):
        n = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def _header(entries) -> bytes:
    """A safetensors header for entries (name, dtype, shape), data laid out in their order; padded with
    spaces to a multiple of 8 bytes, as safetensors writes it, so the data starts aligned."""
    head, at = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        head[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_sharded(out: Path, entries: list[tuple[str, torch.dtype, tuple]], tensors: Iterable[tuple[str, torch.Tensor]],
                  max_bytes: int | None, single: str = SINGLE) -> list[Path]:
    """Write tensors (name, tensor), handed over in the order of entries (name, dtype, shape), into out: one
    file `single` when they fit max_bytes (None: always), else model-0000k-of-0000N.safetensors shards and
    model.safetensors.index.json (transformers' names and index). A tensor that is not what its entry
    planned is an error naming it. Returns the files written."""
    shards = plan_shards(entries, max_bytes) if max_bytes else [list(range(len(entries)))]
    files = ([out / single] if len(shards) == 1 else
             [out / f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    out.mkdir(parents=True, exist_ok=True)
    if single == SINGLE:  # an earlier export's weights in the same directory would be read beside these
        for stale in [out / SINGLE, out / INDEX, *out.glob("model-?????-of-?????.safetensors")]:
            stale.unlink(missing_ok=True)
    where = {i: k for k, shard in enumerate(shards) for i in shard}
    it, handle, k_open = iter(tensors), None, -1
    try:
        for i, (name, dtype, shape) in enumerate(entries):
            got, t = next(it)
            if got != name or t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"export: tensor '{got}' {t.dtype} {tuple(t.shape)} where '{name}' {dtype} "
                                   f"{tuple(shape)} was planned")
            if where[i] != k_open:
                if handle:
                    handle.close()
                k_open = where[i]
                handle = open(files[k_open], "wb")
                handle.write(_header([entries[j] for j in shards[k_open]]))
            if t.numel():
                handle.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t  # not held while the next tensor (perhaps the next layer's file) is read
    finally:
        if handle:
            handle.close()
    if len(shards) > 1:
        total = sum(math.prod(s) * d.itemsize for _, d, s in entries)
        index = {"metadata": {"total_size": total},
                 "weight_map": {entries[i][0]: files[k].name for k, shard in enumerate(shards) for i in shard}}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files
