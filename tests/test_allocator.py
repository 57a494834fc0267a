import subprocess
import sys

import pytest

from sparsegen.allocator import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc's malloc only")

# in a fresh process, as a command runs (a long test session's heap may not grow in place: it is mapped elsewhere)
PROBE = """
import resource, torch
from sparsegen.allocator import reusing_freed_memory

def faults_of_a_second_buffer(mib=256):
    torch.ones(mib << 18)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(mib << 18)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

outside = faults_of_a_second_buffer()
with reusing_freed_memory():
    faults_of_a_second_buffer()  # (the first buffers from the heap may land apart: 2 in 10 runs, seen)
    inside = faults_of_a_second_buffer()
print(outside, inside, faults_of_a_second_buffer())
"""


@pytest.mark.heavy
def test_a_freed_large_buffer_is_reused_inside_and_handed_back_after():
    """Page faults while a 256 MiB buffer is filled just after one of the same size was freed: glibc's default maps
    it anew (one fault a page), inside ``reusing_freed_memory`` its pages are reused, after it they are mapped anew
    again."""
    outside, inside, after = map(int, subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                                     check=True).stdout.split())
    assert outside > 100 and inside < outside / 10 and after > outside / 2, (outside, inside, after)
