"""verify/freed_memory.py off the GPU: the allocation sizes that take the allocator's free blocks (`_requests`) and
`FreeBlocks.written` on CPU tensors. Taking the blocks needs CUDA (tests/test_step_check.py's CUDA tests), which the
CPU suite skips: these are the parts it can check."""

import torch

from verify.freed_memory import POISON, SMALL_REQUEST, FreeBlocks, _requests


def test_requests_take_every_free_byte_and_none_from_the_small_pool_goes_to_the_large_one():
    """The large pool's blocks first, smallest first; then the small pool's whole blocks, smallest first; a small
    block over 1 MiB (a whole free small segment) as 1 MiB and its remainder, for a request over 1 MiB would be
    served from the large pool."""
    blocks = [("large", 20 << 20), ("small", 512), ("small", 2 * SMALL_REQUEST), ("large", 2 << 20),
              ("small", 4096)]
    got = _requests(blocks)
    assert sum(got) == sum(size for _, size in blocks)
    large = sorted(size for kind, size in blocks if kind == "large")
    whole = sorted(size for kind, size in blocks if kind == "small" and size <= SMALL_REQUEST)
    assert got[: len(large) + len(whole)] == large + whole
    assert all(size <= SMALL_REQUEST for size in got[len(large) :])


def test_written_names_each_block_any_byte_of_which_changed():
    """Blocks filled with POISON read as unwritten; one byte changed in a block, whether it lowers its word's value
    (the min moves) or raises it (the max moves), makes that block written, and only it."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.full((n,), POISON, dtype=torch.uint8) for n in (4096, 8192, 512)]  # as FreeBlocks.take fills
    held = FreeBlocks(tensors, left=0)
    assert held.written() is None
    low = int(torch.randint(0, 8192 // 8, (1,), generator=g)) * 8  # a word's least significant byte
    tensors[1][low] = 0  # that int64 word from -1 to -256: the min moves
    assert held.written() is not None and held.written().startswith("1 of the 3 free blocks"), held.written()
    tensors[1][low] = POISON
    high = int(torch.randint(0, 512 // 8, (1,), generator=g)) * 8 + 7  # a word's most significant byte
    tensors[2][high] = 0x7F  # that word from -1 to 2^63 - 1: the max moves
    assert held.written() is not None and held.written().startswith("1 of the 3 free blocks"), held.written()
