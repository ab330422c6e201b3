"""docs/results.md is benchmarks/report.py's output (so it cannot drift from the result files),
every figure it reads exists, and every result a benchmark writes records what made it."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import report  # noqa: E402
from common import write_result  # noqa: E402


def test_results_md_is_the_reports_output():
    expected = report.render()
    actual = (REPO / "docs" / "results.md").read_text()
    assert actual == expected, "docs/results.md is stale: run python benchmarks/report.py"


def test_every_result_json_records_command_device_and_commit():
    for path in sorted((REPO / "benchmarks" / "results").glob("*.json")):
        meta = json.loads(path.read_text()).get("meta", {})
        missing = {"command", "device", "torch", "commit"} - meta.keys()
        assert not missing, f"{path.name} lacks meta fields {sorted(missing)}"


def test_write_result_stamps_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "x.py"), "--quick"])
    out = tmp_path / "sub" / "r.json"
    write_result(out, {"figure": 1.5}, device="cpu", indent=2)
    data = json.loads(out.read_text())
    assert data["figure"] == 1.5
    assert data["meta"]["command"] == "python benchmarks/x.py --quick"
    assert data["meta"]["device"].startswith("cpu")
    assert data["meta"]["commit"] and data["meta"]["torch"]
