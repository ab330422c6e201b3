"""Benchmark result JSON records no absolute machine path (benchmarks/common.py json_args)."""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import json_args  # noqa: E402


def test_paths_are_repo_relative_or_a_bare_file_name(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO / "benchmarks")
    args = argparse.Namespace(
        inside=REPO / "benchmarks" / "results" / "x.json",
        relative=Path("results/y.json"),  # relative to the working directory
        outside=tmp_path / "scratch" / "z.json",
        other=3,
        none=None,
    )
    assert json_args(args) == {
        "inside": "benchmarks/results/x.json",
        "relative": "benchmarks/results/y.json",
        "outside": "z.json",
        "other": 3,
        "none": None,
    }
