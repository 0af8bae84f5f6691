"""The peak RSS a render reports is its own, not the RSS of the process that started it (a process test: it is
about what a fork and exec carry over)."""

import subprocess
import sys

import numpy as np

CHILD = ("import resource; from avatar_cli.report import peak_rss_mb; "
         "print(peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")


def test_a_render_started_by_a_large_process_reports_its_own_peak():
    parent = np.ones(1536 * 2**20 // 8)  # 1.5 GiB touched: this process's RSS when it starts the child
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    own, inherited = map(float, out.split())
    assert inherited >= 1536  # ru_maxrss starts at the parent's RSS at the fork
    assert 0 < own < 1200 and own < inherited - 300  # VmHWM: the child's own address space (torch imported: ~0.5 GiB)
    del parent
