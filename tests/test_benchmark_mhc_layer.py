"""benchmarks/mhc_layer.py's quick mode runs on CPU and writes the keys docs/results.md reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_mhc_layer_quick_writes_dim_and_ratios(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("TRITON_INTERPRET", None)  # the eager mHC path: seconds, not minutes
    cmd = [sys.executable, str(REPO / "benchmarks" / "mhc_layer.py"), "--quick"]
    proc = subprocess.run([*cmd, "--out-dir", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out,) = tmp_path.glob("mhc_layer-cpu-d32-*.json")
    data = json.loads(out.read_text())
    assert data["sizes"]["dim"] == 32 and set(data["variants"]) == {"S1", "S4", "S4_fold"}
    assert {"mhc_S4_over_S1_layer", "mhc_S4_over_S1_step", "mhc_S4_over_S1_layer_fold"} <= set(
        data["ratios"]
    )
    assert all(r["hbm_floor_ms"] > 0 for r in data["variants"].values())
