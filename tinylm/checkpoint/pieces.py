"""Large checkpoint files, written and read in pieces, every piece checked against a manifest.

A large checkpoint of a sharded run is never in one process's memory: torch.save needs every
tensor at once and torch.load reads all of them, while the optimizer state is spread over the
ranks. Such a file is written in two passes that hold one piece of one tensor at a time:

1. `plan_file(path, payload)` writes everything but the tensor data: torch.save under
   torch.serialization.skip_data, with fake tensors (shape and dtype only) standing in for the
   real ones. That is the pickle, the zip headers and directory, and a hole for the bytes of each
   tensor. It returns the file's `Layout`: where each tensor's bytes go, and the sha256 of each
   byte range that is not tensor data (about a hundred bytes per tensor, read back once).
2. `write_tensors(path, items)` fills holes in place: each rank fills those of the tensors it
   holds, hashing each tensor's bytes while writing them, so the file is never read again.

The result is an ordinary torch.save file (tinylm/checkpoint/file.py): a plain
torch.load(path, weights_only=True) reads it. Its manifest entry (`Layout.entry`) cuts the file
into byte ranges, each with its sha256: "records" (one per tensor) and "other" (pickle, headers,
directory). A reader checks exactly the ranges it reads: `CheckpointReader` checks the "other"
ranges, parses the pickle into tensors on the meta device (no data is read), and then reads and
checks one tensor at a time, straight into its destination.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinylm.checkpoint.file import CheckpointError, torch_load

CHUNK_BYTES = 64 << 20  # tensors are written, read and hashed in pieces of at most this size
FLUSH_BYTES = 256 << 20  # fdatasync after this much, so that no single flush is long

TensorPath = tuple[str | int, ...]  # where a tensor sits in a payload: its keys and indices from the top


def tensor_leaves(tree: Any, path: TensorPath = ()) -> Iterator[tuple[TensorPath, torch.Tensor]]:
    """(path, tensor) for every tensor in nested dicts, lists and tuples, in order."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensor_leaves(value, (*path, key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from tensor_leaves(value, (*path, i))


def map_tensors(tree: Any, fn: Callable[[TensorPath, torch.Tensor], Any], path: TensorPath = ()) -> Any:
    """`tree` with every tensor t at `path` replaced by fn(path, t); containers keep their types."""
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, dict):
        return {key: map_tensors(value, fn, (*path, key)) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(map_tensors(value, fn, (*path, i)) for i, value in enumerate(tree))
    return tree


@dataclass
class Layout:
    """Where the data of each tensor of a planned file goes.

    size: the file's length in bytes; records: tensor path -> (offset, nbytes), tensors that share
    storage (tied weights) at the same offset; other: [offset, length, sha256] of every byte range
    that is not tensor data.
    """

    size: int
    records: dict[TensorPath, tuple[int, int]]
    other: list[list]

    def entry(self, hashes: dict[int, tuple[int, str]]) -> dict[str, Any]:
        """The manifest entry of the finished file, given what was written: {byte offset: (nbytes,
        sha256)} of each piece, the pieces of every tensor's bytes tiling it exactly (a tensor of a
        sharded optimizer's state is written in the pieces its ranks hold)."""
        spans = sorted({span for span in self.records.values() if span[1] > 0})
        pieces = sorted((offset, n, sha) for offset, (n, sha) in hashes.items())
        by_offset = {offset: (n, sha) for offset, n, sha in pieces}
        records = []
        for offset, nbytes in spans:
            position = offset
            while position < offset + nbytes and position in by_offset:
                n, sha = by_offset[position]
                records.append([position, n, sha])
                position += n
            if position != offset + nbytes:
                raise RuntimeError(
                    f"no rank wrote the tensor data at byte offsets {position}..{offset + nbytes} "
                    f"(of the tensor at {offset})"
                )
        return {"bytes": self.size, "records": records, "other": self.other}

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "records": [[list(p), o, n] for p, (o, n) in self.records.items()],
            "other": self.other,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layout:
        return cls(data["size"], {tuple(p): (o, n) for p, o, n in data["records"]}, data["other"])


def plan_file(path: str | os.PathLike, payload: Any) -> Layout:
    """Write all of torch.save(payload) to `path` but the tensor data; return where that data goes.

    Tensors may be real or on the meta device (shape and dtype of a tensor held elsewhere); each
    is stored contiguous, in its own storage unless it shares one with another tensor of `payload`.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    path = Path(path)
    mode = FakeTensorMode()
    fakes: dict[Any, torch.Tensor] = {}

    def fake(_, tensor: torch.Tensor) -> torch.Tensor:
        shared = tensor.device.type != "meta" and tensor.numel() > 0
        key = (
            (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()) if shared else id(tensor)
        )
        if key not in fakes:
            with mode:
                fakes[key] = torch.empty(tensor.shape, dtype=tensor.dtype)
        return fakes[key]

    skeleton = map_tensors(payload, fake)
    with torch.serialization.skip_data(materialize_fake_tensors=True), open(path, "wb") as f:
        torch.save(skeleton, f)  # through a handle: the archive is named "archive", not after the file
    records = {
        p: (_data_offset(t), t.numel() * t.element_size())
        for p, t in tensor_leaves(torch.load(path, map_location="meta", weights_only=True))
    }
    expected = [p for p, _ in tensor_leaves(payload)]
    if list(records) != expected:
        raise RuntimeError(f"{path}: the planned file does not hold the payload's tensors in order")
    size = path.stat().st_size
    other, position = [], 0
    with open(path, "rb") as f:
        for offset, nbytes in [*sorted({s for s in records.values() if s[1] > 0}), (size, 0)]:
            if offset > position:
                data = os.pread(f.fileno(), offset - position, position)
                other.append([position, offset - position, hashlib.sha256(data).hexdigest()])
            position = max(position, offset + nbytes)
    return Layout(size, records, other)


def _data_offset(meta: torch.Tensor) -> int:
    """Byte offset in the file of a tensor loaded with map_location="meta"."""
    return meta.untyped_storage()._checkpoint_offset + meta.storage_offset() * meta.element_size()


def write_tensors(
    path: str | os.PathLike, items: list[tuple[int, torch.Tensor]], beat: Callable[[], None] | None = None
) -> dict[int, tuple[int, str]]:
    """Write each (offset, tensor) into the planned file `path`; return {offset: (nbytes, sha256)}.

    A tensor may be a whole tensor of the payload or a part of one (its bytes from `offset` on).
    Tensors may live on any device; they are copied to the host one piece (CHUNK_BYTES) at a time.
    Items at an offset already written (tied tensors) are skipped. `beat` is called after every
    piece (the rank is making progress). The data is on disk (fsynced) when this returns.
    """
    hashes: dict[int, tuple[int, str]] = {}
    fd = os.open(path, os.O_WRONLY)
    try:
        unflushed = 0
        for offset, tensor in sorted(items, key=lambda item: item[0]):
            if offset in hashes or tensor.numel() == 0:
                continue
            digest = hashlib.sha256()
            position = offset
            for piece in _host_pieces(tensor):
                view = memoryview(piece).cast("B")
                while view:
                    written = os.pwrite(fd, view, position)
                    position += written
                    view = view[written:]
                digest.update(piece)
                unflushed += piece.nbytes
                if unflushed >= FLUSH_BYTES:
                    os.fdatasync(fd)
                    unflushed = 0
                if beat is not None:
                    beat()
            hashes[offset] = (tensor.numel() * tensor.element_size(), digest.hexdigest())
        os.fsync(fd)
    finally:
        os.close(fd)
    return hashes


def _host_pieces(tensor: torch.Tensor) -> Iterator[Any]:
    """The bytes of `tensor` (C order) as numpy arrays of at most CHUNK_BYTES, on the host."""
    flat = tensor.detach().reshape(-1)
    flat = flat.contiguous().view(torch.uint8)
    for start in range(0, flat.numel(), CHUNK_BYTES):
        yield flat[start : start + CHUNK_BYTES].cpu().numpy()


class CheckpointReader:
    """Read the tensors of a checkpoint file one at a time, each checked against its manifest entry.

        with CheckpointReader(path, entry) as reader:
            payload = reader.structure          # the payload, every tensor on the meta device
            reader.read_into(payload["model"]["w"], param)   # or reader.read(meta, device)

    Opening checks the file's size and its "other" ranges (pickle, headers) and parses the pickle
    with weights_only=True; no tensor data is read until asked for.
    """

    def __init__(self, path: str | os.PathLike, entry: dict[str, Any]):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"checkpoint not found: {self.path}")
        size = self.path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{self.path}: {size} bytes, its manifest says {entry['bytes']}: the file is "
                f"truncated or was replaced"
            )
        self._records = {offset: (nbytes, sha) for offset, nbytes, sha in entry["records"]}
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            for offset, length, sha in entry["other"]:
                self._check(hashlib.sha256(self._pread(offset, length)).hexdigest(), sha, offset)
            self.structure = torch_load(self.path, "meta")
        except BaseException:
            self.close()
            raise

    def read(
        self, meta: torch.Tensor, device: str | torch.device = "cpu", beat: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """A new tensor on `device` holding the data of `meta` (a tensor of `structure`)."""
        out = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        self.read_into(meta, out, beat)
        return out

    @torch.no_grad()
    def read_into(
        self, meta: torch.Tensor, out: torch.Tensor, beat: Callable[[], None] | None = None
    ) -> None:
        """Fill the contiguous tensor `out` (same shape and dtype as `meta`) with meta's data, checked."""
        if out.shape != meta.shape or out.dtype != meta.dtype:
            raise CheckpointError(
                f"{self.path}: a tensor of shape {tuple(meta.shape)} and dtype {meta.dtype} "
                f"cannot be read into one of shape {tuple(out.shape)} and dtype {out.dtype}"
            )
        offset, nbytes = _data_offset(meta), meta.numel() * meta.element_size()
        if nbytes == 0:
            return
        flat = out.view(-1).view(torch.uint8)  # a view: the bytes of `out` itself
        for position, n in self._pieces(offset, nbytes):
            self._read_piece(position, flat[position - offset : position - offset + n], beat)

    @torch.no_grad()
    def read_range(
        self,
        meta: torch.Tensor,
        start: int,
        stop: int,
        device: str | torch.device = "cpu",
        beat: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The elements [start, stop) of `meta`'s data (flattened), a new 1-D tensor on `device`.

        Every piece of the file that overlaps them is read and checked whole (at the world size
        that wrote the file, exactly the part asked for), so at most a piece more is read.
        """
        element = meta.element_size()
        if not 0 <= start <= stop <= meta.numel():
            raise CheckpointError(f"{self.path}: elements {start}..{stop} of a tensor of {meta.numel()}")
        out = torch.empty(stop - start, dtype=meta.dtype, device=device)
        if stop == start:
            return out
        offset = _data_offset(meta)
        low, high = offset + start * element, offset + stop * element
        flat = out.view(torch.uint8)
        for position, n in self._pieces(offset, meta.numel() * element):
            if position + n <= low or position >= high:
                continue
            piece = torch.empty(n, dtype=torch.uint8)
            self._read_piece(position, piece, beat)
            a, b = max(low, position), min(high, position + n)
            flat[a - low : b - low].copy_(piece[a - position : b - position])
        return out

    def _pieces(self, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """(offset, nbytes) of the manifest's pieces that tile the tensor bytes [offset, offset + nbytes)."""
        pieces, position = [], offset
        while position < offset + nbytes:
            n = self._records.get(position, (None,))[0]
            if n is None or position + n > offset + nbytes:
                raise CheckpointError(
                    f"{self.path}: its manifest lists no tensor of {nbytes} bytes at byte {offset}"
                )
            pieces.append((position, n))
            position += n
        return pieces

    def _read_piece(self, offset: int, out: torch.Tensor, beat: Callable[[], None] | None) -> None:
        """Fill `out` (uint8, any device) with the piece at `offset`, checked against its sha256."""
        nbytes = out.numel()
        staging = (
            None if out.device.type == "cpu" else torch.empty(min(nbytes, CHUNK_BYTES), dtype=torch.uint8)
        )
        digest = hashlib.sha256()
        for start in range(0, nbytes, CHUNK_BYTES):
            length = min(CHUNK_BYTES, nbytes - start)
            target = out[start : start + length] if staging is None else staging[:length]
            buffer = memoryview(target.numpy()).cast("B")
            self._pread_into(buffer, offset + start)
            digest.update(buffer)
            if staging is not None:
                out[start : start + length].copy_(target)
            if beat is not None:
                beat()
        self._check(digest.hexdigest(), self._records[offset][1], offset)

    def verify(self) -> None:
        """Check the bytes of every tensor in the file against the manifest, keeping none of them: a
        whole read of the file, for a reader that must know it is intact before it starts."""
        buffer = memoryview(bytearray(CHUNK_BYTES))
        for offset, (nbytes, sha) in sorted(self._records.items()):
            digest = hashlib.sha256()
            for start in range(0, nbytes, CHUNK_BYTES):
                chunk = buffer[: min(CHUNK_BYTES, nbytes - start)]
                self._pread_into(chunk, offset + start)
                digest.update(chunk)
            self._check(digest.hexdigest(), sha, offset)

    def _pread(self, offset: int, length: int) -> bytes:
        data = os.pread(self._fd, length, offset)
        if len(data) != length:
            raise CheckpointError(f"{self.path}: truncated at byte {offset + len(data)}")
        return data

    def _pread_into(self, buffer: memoryview, offset: int) -> None:
        while buffer:
            n = os.preadv(self._fd, [buffer], offset)
            if n == 0:
                raise CheckpointError(f"{self.path}: truncated at byte {offset}")
            buffer, offset = buffer[n:], offset + n

    def _check(self, actual: str, expected: str, offset: int) -> None:
        if actual != expected:
            raise CheckpointError(
                f"{self.path}: the bytes at offset {offset} do not match the sha256 in its "
                f"manifest ({actual[:16]}... instead of {expected[:16]}...): the file is corrupt"
            )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
