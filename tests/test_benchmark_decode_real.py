"""benchmarks/decode_real.py's quick mode (a tiny local Llama imported dense and S=4, M=1, the
MTP warm-up, plain and speculative decode) runs on CPU and writes its flat keys."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_decode_real_quick_writes_the_headline_keys(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "decode_real.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "decode_real.py"),
        "--quick",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for key in ("smollm2_dense_b1_tok_s", "smollm2_dense_b2_tok_s", "smollm2_s4_b1_tok_s",
                "smollm2_s4_b2_tok_s", "smollm2_spec_b1_k2_speedup", "smollm2_spec_b2_k2_speedup",
                "smollm2_s4_b1_bound_frac", "smollm2_spec_b1_k2_mean_accepted_length"):  # fmt: skip
        assert data[key] > 0, key
    assert len(data["smollm2_spec_b1_k2_acceptance"]) == 2
    assert all(0 <= a <= 1 for a in data["smollm2_spec_b2_k1_acceptance"])
    assert data["distill"]["steps"] == 2 and data["distill"]["weight_version"] == 1
    assert data["copy_bandwidth_bytes_per_s"] > 0 and {"command", "commit"} <= data["meta"].keys()
    rows = data["s4"] + data["dense"]
    assert all(r["seconds"] > 0 and r["bytes_per_step"] > 0 for r in rows)
