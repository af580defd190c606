"""What one update communicates per rank, planned from the parameters' sizes alone.

    plan = plan_communication(specs, world_size, bucket_bytes, sharded=True)
    plan.seconds(LINKS["nvlink"])        # the collectives' time at that link's bandwidth and latency

The collectives are exactly those tinylm's DDP and ShardedOptimizer issue in one update (after the
accumulation micro-steps, which communicate nothing):

- unsharded: one all-reduce per gradient bucket (tinylm/parallel/ddp.py's buckets);
- sharded (ZeRO-1): per bucket of the shard layout (tinylm/parallel/shard_layout.py), one
  reduce-scatter of its gradients during backward and one all-gather of its parameters after
  the optimizer step, each of the whole bucket (slot padding included);
- and in both, small all-reduces: the flags of which ranks produced each gradient (4 bytes per
  parameter tensor), the loss (4 bytes), and, sharded, the clip's squared norms (4 bytes per
  parameter tensor).

Bytes sent per rank, for a collective over n bytes in a world of w, are the ring algorithm's: an
all-reduce 2 (w - 1) / w n, a reduce-scatter or an all-gather (w - 1) / w n. Time is the same
model: the bytes at the link's bandwidth, plus (w - 1) latencies for a reduce-scatter or an
all-gather and 2 (w - 1) for an all-reduce (a ring's steps). NCCL picks other algorithms (trees)
for small messages at large w, so the latency term is an upper bound there; the bandwidth term
is the part that large buckets pay.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinylm.parallel.shard_layout import ParamSpec, plan_shards, split_by_bytes


@dataclass(frozen=True)
class Link:
    """A link's bandwidth per rank (bytes/s, one direction) and latency per ring step (s)."""

    name: str
    bandwidth: float
    latency: float
    about: str


# Nominal figures (not measured here): what each class of link gives one GPU.
LINKS = {
    "nvlink": Link("nvlink", 450e9, 5e-6, "NVLink 4 within a node (H100/H200: 450 GB/s per GPU each way)"),
    "infiniband": Link("infiniband", 50e9, 10e-6, "InfiniBand NDR between nodes (400 Gb/s per GPU)"),
}
GPUS_PER_NODE = 8  # past this, a ring crosses nodes: the default link is InfiniBand's


@dataclass(frozen=True)
class Collective:
    kind: str  # "all_reduce", "reduce_scatter", "all_gather"
    nbytes: int  # the full tensor: what is reduced, or what is gathered
    when: str  # "backward" (overlaps it), "after step" (parameters, before the next forward), "step"


@dataclass
class CommunicationPlan:
    """The collectives of one update on one rank, in the order they are issued."""

    world_size: int
    collectives: list[Collective]

    def sent_bytes(self, when: str | None = None) -> float:
        """Bytes this rank sends (ring algorithms), of the collectives issued `when` (all: None)."""
        return sum(self._sent(c) for c in self.collectives if when in (None, c.when))

    def sent_bytes_of(self, kind: str) -> float:
        """Bytes this rank sends in the collectives of `kind`."""
        return sum(self._sent(c) for c in self.collectives if c.kind == kind)

    def _sent(self, c: Collective) -> float:
        w = self.world_size
        return (2 if c.kind == "all_reduce" else 1) * (w - 1) / w * c.nbytes

    def calls(self, kind: str | None = None, when: str | None = None) -> int:
        """How many collectives of `kind` issued `when` (None: any)."""
        return sum(1 for c in self.collectives if kind in (None, c.kind) and when in (None, c.when))

    def seconds(self, link: Link, when: str | None = None) -> float:
        """The collectives' time at `link`: bandwidth and latency terms (see the module docs)."""
        hops = sum(
            (2 if c.kind == "all_reduce" else 1) * (self.world_size - 1)
            for c in self.collectives
            if when is None or c.when == when
        )
        return self.sent_bytes(when) / link.bandwidth + hops * link.latency


def plan_communication(
    specs: list[ParamSpec], world_size: int, bucket_bytes: float, sharded: bool
) -> CommunicationPlan:
    """The collectives of one update of parameters `specs` (trainable, in registration order)."""
    if world_size == 1:
        return CommunicationPlan(1, [])
    small = 4 * len(specs)  # one float32 per parameter tensor
    collectives: list[Collective] = []
    if sharded:
        buckets = plan_shards(specs, world_size, bucket_bytes)
        element = [specs[b.members[0]].element_size for b in buckets]
        collectives += [
            Collective("reduce_scatter", b.numel * e, "backward")
            for b, e in zip(buckets, element, strict=True)
        ]
        collectives += [Collective("all_reduce", small, "step"), Collective("all_reduce", 4, "step")]
        collectives.append(Collective("all_reduce", small, "step"))  # the clip's squared norms
        collectives += [
            Collective("all_gather", b.numel * e, "after step") for b, e in zip(buckets, element, strict=True)
        ]
    else:
        for members in split_by_bytes(
            list(reversed(range(len(specs)))), specs, bucket_bytes
        ):  # DDP's buckets
            nbytes = sum(specs[i].numel * specs[i].element_size for i in members)
            collectives.append(Collective("all_reduce", nbytes, "backward"))
        collectives += [Collective("all_reduce", small, "step"), Collective("all_reduce", 4, "step")]
    return CommunicationPlan(world_size, collectives)


def default_link(world_size: int) -> Link:
    """NVLink within one node of GPUS_PER_NODE, InfiniBand beyond."""
    return LINKS["nvlink"] if world_size <= GPUS_PER_NODE else LINKS["infiniband"]


def parse_link(value: str) -> Link:
    """--plan-bandwidth: a named link ("nvlink", "infiniband") or a bandwidth in GB/s per rank."""
    if value in LINKS:
        return LINKS[value]
    try:
        gb_per_s = float(value)
    except ValueError:
        gb_per_s = 0.0
    if gb_per_s <= 0:
        raise ValueError(
            f"--plan-bandwidth {value!r}: one of {', '.join(LINKS)} or a bandwidth in GB/s per rank, e.g. 100"
        )
    return Link(f"{gb_per_s:g} GB/s", gb_per_s * 1e9, LINKS["infiniband"].latency, "given")
