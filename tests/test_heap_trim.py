"""Freed C-heap memory (gRPC's receive buffers on a cluster) goes back to the system
after a run (``session.heap_trimmer``); its effect on a two-node run's peak memory
is measured by benchmarks/model_scale.py."""
import ctypes
import ctypes.util

import pytest

from autodist.session import heap_trimmer

pytestmark = pytest.mark.timeout(60)

BLOCK = 64 << 10  # below glibc's mmap threshold: the block comes from the heap
BLOCKS = 2048  # 128 MiB


def _resident_mib() -> float:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def test_the_trimmer_hands_freed_heap_pages_back():
    trim = heap_trimmer()
    if trim is None:
        pytest.skip("this C library has no malloc_trim")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)
    for block in blocks[:-1]:  # the last one pins the heap's top: no automatic trim
        libc.free(block)
    before = _resident_mib()
    trim()
    after = _resident_mib()
    libc.free(blocks[-1])
    assert before - after > 0.8 * BLOCK * BLOCKS / 2 ** 20, (before, after)
