import resource

import pytest
import torch

from sparsegen.allocator import _glibc, reusing_freed_memory

pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc's malloc only")


def _faults_of_a_second_buffer(mib: int = 256) -> int:
    """Page faults while a buffer of ``mib`` MiB is filled, just after one of the same size was filled and freed."""
    torch.ones(mib << 18)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(mib << 18)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_freed_large_buffer_is_reused_inside_and_handed_back_after():
    outside = _faults_of_a_second_buffer()
    assert outside > 100  # glibc's default: mapped anew and faulted in (one fault a 4 KiB page, or a 2 MiB huge one)
    with reusing_freed_memory():
        _faults_of_a_second_buffer()  # (the first buffers from the heap may land apart: 2 in 10 runs, seen)
        assert _faults_of_a_second_buffer() < outside / 10  # the freed buffer's pages, reused
    assert _faults_of_a_second_buffer() > outside / 2  # glibc's thresholds back: mapped anew again
