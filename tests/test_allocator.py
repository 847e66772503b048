"""fedlmc.scale.allocator: a retaining heap keeps freed memory resident; releasing it hands it back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_release_freed_memory_hands_a_retained_heap_back_to_the_kernel():
    # in a child process: the thresholds are process-wide and would outlive this test
    script = textwrap.dedent("""
        import os, torch
        from pathlib import Path
        from fedlmc.scale.allocator import release_freed_memory, retain_freed_memory

        def rss():
            return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        if not retain_freed_memory():
            print("SKIP"); raise SystemExit
        base = rss()
        blocks = [torch.ones(1 << 18) for _ in range(300)]  # 300 MB in 1 MB tensors: heap, not mmap
        del blocks
        kept = rss() - base
        assert release_freed_memory()
        print(kept, rss() - base)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    if out.strip() == "SKIP":
        pytest.skip("not glibc")
    kept, after = (int(v) for v in out.split())
    assert kept > 250e6  # the retaining heap kept what was freed ...
    assert after < 50e6  # ... and releasing returned it
