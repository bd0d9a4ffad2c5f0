"""Writes into freed device memory: the bug of a CUDA-graph step whose plan() replaces a buffer the graph captured.

A captured graph holds raw device addresses. A step whose plan() allocates a new workspace (or metadata buffer) and
drops the old one leaves the graph pointing at a block that torch's caching allocator holds free: the next replay
writes its partials there and reads them back, so its answers are right, while any tensor that later takes the
block is silently overwritten. Nothing in the outputs shows it.

`FreeBlocks.take` makes it show: it allocates every free block of the allocator's default pool on the current
stream (exact sizes, smallest first, so that each request takes a block of its own size and none splits a larger
one or asks the driver for more: `_requests`), fills them with 0xFF bytes (NaN in every float format, -1 in every
signed int), and `written` says afterwards which of them changed. Between the two, the memory a step no longer
owns is owned by these tensors, as it could be by any tensor of the serving engine.
"""

from __future__ import annotations

import dataclasses

import torch

POISON = 0xFF  # the fill byte: int64 -1 per 8 bytes
SMALL_REQUEST = 1 << 20  # the allocator serves requests of up to 1 MiB from its small pool (2 MiB segments)


def _free_blocks(device: torch.device) -> list[tuple[str, int]]:
    """(segment type, size in bytes) of every inactive block of the default pool on ``device`` and its current
    stream: the blocks an allocation here can take (a graph's private pool, other streams and blocks waiting for
    another stream are left out)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    return [(segment["segment_type"], block["size"]) for segment in torch.cuda.memory_snapshot()
            if segment.get("device", index) == index and segment["stream"] == stream
            and tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)
            for block in segment["blocks"] if block["state"] == "inactive"]


def _requests(blocks: list[tuple[str, int]]) -> list[int]:
    """Allocation sizes that take exactly ``blocks``, in order. The allocator gives a request the smallest free
    block of its pool that fits, splitting it: exact sizes smallest first take one block each. A small-pool block
    over 1 MiB (a whole free small segment) cannot be one request (it would go to the large pool): it is taken as
    1 MiB and then its remainder, after every smaller block is gone."""
    large = sorted(size for kind, size in blocks if kind != "small")
    small = sorted(size for kind, size in blocks if kind == "small")
    whole = [size for size in small if size <= SMALL_REQUEST]
    split = [part for size in small if size > SMALL_REQUEST for part in (SMALL_REQUEST, size - SMALL_REQUEST)]
    return large + whole + split


@dataclasses.dataclass
class FreeBlocks:
    """The allocator's free blocks, held by ``tensors`` (uint8, filled with POISON) until dropped; ``left``: the
    free bytes the requests did not take (0 when the allocator behaved as `_requests` expects)."""

    tensors: list[torch.Tensor]
    left: int

    @staticmethod
    def supported() -> bool:
        """Whether torch's caching allocator is the native one (cudaMallocAsync keeps no blocks to snapshot)."""
        return torch.cuda.get_allocator_backend() == "native"

    @classmethod
    def take(cls, device: torch.device | str) -> FreeBlocks:
        """Every free block `_free_blocks` lists, allocated and poisoned; block sizes are multiples of 512 bytes, so
        each tensor is a whole number of int64 words. Under other allocator settings (expandable segments, sizes
        rounded up to powers of two) a request may miss its block: the first that makes the allocator reserve
        more memory is given back and ends the taking, and ``left`` counts what stayed free."""
        device = torch.device(device)
        reserved, tensors = torch.cuda.memory_reserved(device), []
        for size in _requests(_free_blocks(device)):
            tensors.append(torch.empty(size, dtype=torch.uint8, device=device))
            if torch.cuda.memory_reserved(device) > reserved:
                tensors.pop()
                break
        for t in tensors:
            t.fill_(POISON)
        return cls(tensors, sum(size for _, size in _free_blocks(device)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors)

    def written(self) -> str | None:
        """None when every held block still holds POISON in every byte; else which blocks changed, e.g. "1 of the
        19 free blocks (0.2 MB of 71.5 MB) changed". One int64 min/max per block, no temporary of a block's size."""
        if not self.tensors:
            return None
        ends = torch.stack([torch.stack(torch.aminmax(t.view(torch.int64))) for t in self.tensors])  # [blocks, 2]
        changed = [t for t, moved in zip(self.tensors, ends.ne(-1).any(1).tolist()) if moved]
        if not changed:
            return None
        changed_bytes = sum(t.numel() for t in changed)
        return (f"{len(changed)} of the {len(self.tensors)} free blocks ({size_text(changed_bytes)} of "
                f"{size_text(self.nbytes)}) changed")


def size_text(nbytes: int) -> str:
    """A byte count for a report: "0.2 MB", "4.1 kB"."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes / 1e3:.1f} kB"
