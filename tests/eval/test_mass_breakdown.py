"""tools/mass_breakdown.py on the tiny random model: one line per selector and layer, and the
three parts of the dense mass it reports add up to the whole (1) while the kept parts add up to
the printed recall."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_breakdown_lines_add_up():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "mass_breakdown.py"), "--model", "tiny-random",
                          "--length", "300", "--budget", "32", "--recent", "28", "--steps", "2", "--threads", "1",
                          "--selectors", "oracle_topk", "streaming"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = re.findall(r"(\w+) +layer +(\d+): recall ([\d.]+) \| sinks ([\d.]+) of ([\d.]+) \| middle ([\d.]+) of "
                      r"([\d.]+) \| last 28 ([\d.]+) of ([\d.]+)", out)
    assert {(r[0], r[1]) for r in rows} == {(s, l) for s in ("oracle_topk", "streaming") for l in ("0", "1")}, out
    for name, _, recall, *parts in rows:
        kept, dense = [float(x) for x in parts[0::2]], [float(x) for x in parts[1::2]]
        assert abs(sum(dense) - 1.0) < 2e-3 and abs(sum(kept) - float(recall)) < 2e-3
        assert all(k <= d + 1e-3 for k, d in zip(kept, dense))
        if name == "streaming":  # 4 sinks + the last 28 (budget 32): nothing of the middle, all of the recent part
            assert float(parts[2]) == 0.0 and abs(float(parts[4]) - float(parts[5])) < 2e-3
