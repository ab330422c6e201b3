"""benchmarks/v4_cost.py --quick runs on CPU and writes the ratios and parts docs/v4.md reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_v4_cost_quick_writes_ratios_and_parts(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    cmd = [sys.executable, str(REPO / "benchmarks" / "v4_cost.py"), "--quick"]
    proc = subprocess.run([*cmd, "--out-dir", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "v4_cost-cpu-quick.json").read_text())
    assert set(data["kinds"]) == {"sliding", "csa", "hca"} and "meta" in data
    for kind in ("csa", "hca"):
        for what in ("train", "decode"):
            assert data[f"{kind}_over_sliding_{what}"] > 0
    parts = {k: v["train"]["parts_ms"] for k, v in data["kinds"].items()}
    assert parts["sliding"]["compressor"] == parts["sliding"]["indexer"] == 0.0
    assert parts["csa"]["indexer"] > 0 and parts["hca"]["indexer"] == 0.0
    assert parts["hca"]["compressor"] > 0 and all(p["moe"] > 0 for p in parts.values())
    assert data["kinds"]["csa"]["decode"]["parts_ms"]["indexer"] > 0
