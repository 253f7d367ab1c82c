"""benchmarks/soak.py's short run: kvgen serve under 30 s of mixed load (greedy answers checked against generate(),
sampled, streamed, n=3, structured, cancelled, malformed, out-of-range and too-long requests, bursts past the queue)
with Redis killed and started again: no 5xx, no wrong answer, no failed request, no KV block held after the drain."""

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def test_a_short_soak_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(SOAK), "--minutes", "0.5", "--clients", "16", "--max-queue", "8",
                          "--burst-every", "10", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert all(report["checks"].values()) and len(report["checks"]) == 7, report["checks"]
    outcomes = report["outcomes"]
    for kind in ("greedy ok", "cancel cancelled", "malformed 400", "out_of_range 400", "too_long 400", "burst 429"):
        assert outcomes.get(kind, 0) > 0, (kind, outcomes)
    assert (report["server_errors"], report["wrong_answers"], report["kv_blocks_used_after_drain"]) == (0, 0, 0)
    assert report["redis"]["store_available_during_outage"] == 0  # the outage happened, and nothing failed
