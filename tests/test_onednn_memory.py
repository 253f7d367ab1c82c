"""oneDNN's matmuls for new input shapes are cached within a bound: a server's memory does not grow with them."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

# 240 row counts through kvgen's oneDNN product, two weights each; the resident size after the first 80 (the caches
# full) against the end. With oneDNN's defaults (1,024 entries each) it grew 357 MB (AMD EPYC Zen 3); with kvgen's
# 64, 49 MB (entries for more rows hold more). The limit leaves room for CPUs whose kernels keep twice as much.
SCRIPT = textwrap.dedent("""
    import torch
    import kvgen
    from kvgen.models.linear import matmul

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

    torch.set_num_threads(2)
    torch.set_grad_enabled(False)  # (with autograd, matmul is F.linear's)
    weights = [torch.randn(1536, 576), torch.randn(576, 1536)]
    for i, rows in enumerate(range(300, 540)):
        for w in weights:
            matmul(torch.randn(rows, w.shape[1]), w)
        if i == 80:
            start = rss_mb()
    print(rss_mb() - start)
""")


def test_onednn_caches_are_bounded_by_kvgen():
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    growth = float(run.stdout.split()[-1])
    assert growth < 200, f"resident memory grew {growth:.0f} MB over 160 new input shapes"


def test_a_capacity_the_user_set_is_kept():
    code = "import os; os.environ['LRU_CACHE_CAPACITY'] = '7'; import kvgen; print(os.environ['LRU_CACHE_CAPACITY'], " \
           "os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.split() == ["7", "64"], run.stderr
