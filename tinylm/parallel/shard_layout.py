"""Where each parameter sits in the flat buckets of a sharded optimizer, and which rank holds what.

No tensors here: a layout is computed from the parameters' sizes alone, so that the optimizer
(tinylm/parallel/sharded.py), DDP's gradient buckets, the memory plan and the communication plan
all read one answer.

A bucket is one flat buffer cut into `world_size` equal slots of `slot_numel` elements; rank r
holds slot r. Gradients are reduce-scattered into the slots and the stepped slots all-gathered
back, one collective of each per bucket. Two kinds of bucket:

- elementwise (AdamW, and any optimizer whose update of an element reads only that element): the
  parameters are laid end to end (each at a 64-byte boundary) and cut anywhere, so every rank
  holds within one alignment of 1/world_size of the bucket; a parameter may be split across ranks;
- whole (the matrices of Muon, whose update needs the whole matrix): matrices of one shape and
  group, each placed whole inside one slot; each bucket gives every rank floor(k / world_size)
  of its k matrices and the k mod world_size left over to the ranks with the least work so far
  (Newton-Schulz's cost, numel x min(rows, cols)), ties to the lower rank. The slots are as
  large as the largest share: the others are padded, so a bucket of k matrices moves
  world_size x ceil(k / world_size) matrices' bytes. A bucket holds a multiple of world_size
  matrices and at least world_size (or all there are), even past `bucket_bytes`.

Elementwise buckets hold at most `bucket_bytes` (a larger parameter gets a bucket of its own) of
one dtype and device; a bucket of fewer elements than ranks joins its neighbour, and a world
larger than all the elements of a kind is refused (a ValueError naming the world size). Buckets
are listed in the order their gradients complete in backward (the order DDP starts them): by the
earliest-registered parameter they hold, last first.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN_BYTES = 64  # every parameter (and slot) starts at a multiple of this in its bucket


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs of a parameter: its size, shape, element size, kind and group."""

    numel: int
    shape: tuple[int, ...]
    element_size: int
    kind: tuple  # parameters of another kind (dtype, device) never share a bucket
    group: int  # its param group's index
    whole: bool  # its update needs the whole tensor (Muon's matrices)


@dataclass(frozen=True)
class Piece:
    """The elements [start, stop) of parameter `index`, held by one rank, at `offset` in its bucket."""

    index: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: members (parameter indices, in layout order) at `offsets`, in world_size slots."""

    members: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]  # each member's numel
    slot_numel: int
    world_size: int
    whole: bool

    @property
    def numel(self) -> int:
        return self.slot_numel * self.world_size

    def slot(self, rank: int) -> tuple[int, int]:
        """[start, stop) of rank's slot, in elements of the bucket."""
        return rank * self.slot_numel, (rank + 1) * self.slot_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of the members that fall in rank's slot, in layout order."""
        low, high = self.slot(rank)
        held = []
        for index, offset, size in zip(self.members, self.offsets, self.sizes, strict=True):
            start, stop = max(low, offset), min(high, offset + size)
            if start < stop:
                held.append(Piece(index, start - offset, stop - offset, start))
        return held


def plan_shards(specs: list[ParamSpec], world_size: int, bucket_bytes: float) -> list[BucketLayout]:
    """The buckets of `specs` (parameters in registration order) for `world_size` ranks; see module docs."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    keyed: list[tuple[int, BucketLayout]] = []  # (earliest member, bucket)
    reverse = [i for i in reversed(range(len(specs))) if specs[i].numel > 0]

    elementwise = split_by_bytes([i for i in reverse if not specs[i].whole], specs, bucket_bytes)
    for b in reversed(range(len(elementwise))):  # a bucket too small to give every rank an element
        if b >= len(elementwise) or sum(specs[i].numel for i in elementwise[b]) >= world_size:
            continue
        kind = specs[elementwise[b][0]].kind
        before = b > 0 and specs[elementwise[b - 1][0]].kind == kind
        after = b + 1 < len(elementwise) and specs[elementwise[b + 1][0]].kind == kind
        if before or after:  # it joins the bucket before it (or, the first, the one after)
            tiny = elementwise.pop(b)
            elementwise[b - 1 if before else b] += tiny
    for members in elementwise:
        numel = sum(specs[i].numel for i in members)
        if numel < world_size:
            raise ValueError(
                f"world size {world_size}: a bucket of {numel} elements cannot give each rank a slice; "
                f"these {numel} parameter elements are all there are of their kind (use fewer ranks, or "
                f"shard_optimizer: false)"
            )
        members = sorted(members, key=lambda i: specs[i].group)  # each group's members in one run
        keyed.append((min(members), _elementwise_bucket(members, specs, world_size)))

    work = [0] * world_size
    families: dict[tuple, list[int]] = {}
    for i in reverse:
        if specs[i].whole:
            families.setdefault((specs[i].kind, specs[i].shape, specs[i].group), []).append(i)
    for family in families.values():
        spec = specs[family[0]]
        # A multiple of world_size matrices per bucket, at least world_size: a bucket of fewer
        # would pad its slots to a matrix each. The remainder joins the last full bucket.
        fits = int(bucket_bytes // (spec.numel * spec.element_size))
        per_bucket = max(world_size, fits - fits % world_size)
        chunks = [family[start : start + per_bucket] for start in range(0, len(family), per_bucket)]
        if len(chunks) > 1 and len(chunks[-1]) < world_size:
            last = chunks.pop()
            chunks[-1] += last
        for members in chunks:
            keyed.append((min(members), _whole_bucket(members, specs, world_size, work)))
    return [bucket for _, bucket in sorted(keyed, key=lambda item: -item[0])]


def split_by_bytes(order: list[int], specs: list[ParamSpec], bucket_bytes: float) -> list[list[int]]:
    """`order` (parameter indices) cut into runs of at most `bucket_bytes` of one kind each, as DDP
    cuts its buckets; a parameter larger than the limit gets a run of its own."""
    buckets: list[list[int]] = []
    size = 0
    for i in order:
        nbytes = specs[i].numel * specs[i].element_size
        if buckets and size + nbytes <= bucket_bytes and specs[buckets[-1][0]].kind == specs[i].kind:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


def _align(numel: int, element_size: int) -> int:
    align = max(1, ALIGN_BYTES // element_size)
    return -(-numel // align) * align


def _elementwise_bucket(members: list[int], specs: list[ParamSpec], world_size: int) -> BucketLayout:
    element_size = specs[members[0]].element_size
    offsets, end = [], 0
    for i in members:
        offsets.append(end)
        end += _align(specs[i].numel, element_size)
    slot = _align(-(-end // world_size), element_size)
    sizes = tuple(specs[i].numel for i in members)
    return BucketLayout(tuple(members), tuple(offsets), sizes, slot, world_size, whole=False)


def _whole_bucket(
    members: list[int], specs: list[ParamSpec], world_size: int, work: list[int]
) -> BucketLayout:
    """Matrices of one shape, whole in the slots; `work` (per rank, so far) is updated in place."""
    spec = specs[members[0]]
    base, extra = divmod(len(members), world_size)
    lucky = sorted(range(world_size), key=lambda r: (work[r], r))[:extra]
    counts = [base + (r in lucky) for r in range(world_size)]
    matrix_work = spec.numel * min(spec.shape)
    for r in range(world_size):
        work[r] += counts[r] * matrix_work
    stride = _align(spec.numel, spec.element_size)
    slot = max(counts) * stride
    offsets = [r * slot + j * stride for r, count in enumerate(counts) for j in range(count)]
    sizes = tuple(spec.numel for _ in members)
    return BucketLayout(tuple(members), tuple(offsets), sizes, slot, world_size, whole=True)


def held_elements(buckets: list[BucketLayout], world_size: int) -> list[int]:
    """Per rank: the parameter elements it holds (and steps) over all buckets."""
    return [sum(piece.numel for bucket in buckets for piece in bucket.pieces(r)) for r in range(world_size)]


def newton_schulz_work(buckets: list[BucketLayout], specs: list[ParamSpec], world_size: int) -> list[int]:
    """Per rank: the Newton-Schulz work (numel x min(rows, cols) per matrix) of its whole matrices."""
    return [
        sum(
            specs[piece.index].numel * min(specs[piece.index].shape)
            for bucket in buckets
            if bucket.whole
            for piece in bucket.pieces(r)
        )
        for r in range(world_size)
    ]
