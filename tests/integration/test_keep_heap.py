"""`keep_heap`: the training commands' large tensors come from the heap, not from a fresh
mapping per allocation (glibc's mallinfo2 counts the mapped bytes)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """
import ctypes, sys
import torch
from cluster.cli.training import keep_heap

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "keep":
    assert keep_heap()
before = libc.mallinfo2()
x = torch.ones(64 << 18)  # 64 MiB of float32
during = libc.mallinfo2()
print(during.hblkhd - before.hblkhd, during.arena - before.arena)
"""


def _grown(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    mapped, heap = map(int, out.stdout.split())
    return mapped, heap


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="not glibc 2.33+")
def test_keep_heap_serves_large_tensors_from_the_heap():
    mapped, heap = _grown("default")
    assert mapped >= 64 << 20 and heap < 64 << 20  # glibc's default: a mapping of its own
    mapped, heap = _grown("keep")
    assert mapped == 0 and heap >= 64 << 20  # kept: the heap grows, and later steps reuse it
