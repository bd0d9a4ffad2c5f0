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


def test_free_blocks_are_the_inactive_blocks_of_the_default_pool_on_this_device_and_stream(monkeypatch):
    """`_free_blocks` on a memory snapshot (torch.cuda.memory_snapshot's segments, stubbed here): an allocation on
    this device and current stream can take only the inactive blocks of its own segments; another device's, another
    stream's, a CUDA graph's private pool's and active blocks are left out. A segment without a device or pool id
    (older torch) counts as this device's and the default pool's."""
    from types import SimpleNamespace

    from verify import freed_memory

    def segment(blocks, device=1, stream=7, pool=(0, 0), kind="large"):
        return {"device": device, "stream": stream, "segment_pool_id": pool, "segment_type": kind,
                "blocks": [{"size": size, "state": state} for size, state in blocks]}

    snapshot = [
        segment([(2 << 20, "inactive"), (1 << 20, "active_allocated"), (512, "inactive")]),  # two taken
        segment([(4096, "inactive")], kind="small"),  # taken
        segment([(8192, "inactive")], device=0),  # another device
        segment([(16384, "inactive")], stream=8),  # another stream
        segment([(32768, "inactive")], pool=(1, 3)),  # a graph's private pool
        {"stream": 7, "segment_type": "small", "blocks": [{"size": 1024, "state": "inactive"}]},  # no device / pool
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    expected = [("large", 2 << 20), ("large", 512), ("small", 4096), ("small", 1024)]
    assert freed_memory._free_blocks(torch.device("cuda", 1)) == expected
    assert freed_memory._free_blocks(torch.device("cuda")) == expected  # no index: the current device, 1


def test_take_poisons_what_it_takes_and_gives_back_the_request_that_made_the_allocator_reserve_more(monkeypatch):
    """`FreeBlocks.take` on CPU tensors, the allocator stubbed: the third request grows the reserved memory (a
    request that missed its block, as under expandable segments), so it is freed and the taking ends there; the two
    held blocks are poisoned, and `left` is what the allocator then lists as free."""
    from verify import freed_memory

    held: list[int] = []
    free_now = [("large", 1 << 20), ("large", 4096), ("large", 8192), ("large", 512)]
    listed = iter([free_now, [("large", 8192), ("large", 512)]])  # before the taking, after it
    monkeypatch.setattr(freed_memory, "_free_blocks", lambda device: next(listed))
    real_empty = torch.empty

    def empty(size, dtype, device):
        held.append(size)
        return real_empty(size, dtype=dtype)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 1 << 30 if len(held) >= 3 else 1 << 29)
    taken = FreeBlocks.take("cpu")
    assert held == _requests(free_now)[:3]  # the third was asked for, then given back
    assert [t.numel() for t in taken.tensors] == held[:2] == [512, 4096]
    assert all(bool((t == POISON).all()) for t in taken.tensors) and taken.written() is None
    assert taken.left == 8192 + 512 and taken.nbytes == 512 + 4096
