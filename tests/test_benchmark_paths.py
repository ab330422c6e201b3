"""Benchmark helpers: result JSON records no absolute machine path (benchmarks/common.py
json_args); GPU busy time counts overlapping kernels once (covered_us)."""

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


def test_busy_time_counts_overlapping_kernels_once():
    from common import covered_us

    # two streams: (5, 12) overlaps (0, 10); (21, 22) lies inside (20, 25); unsorted input
    assert covered_us([(20, 25), (0, 10), (21, 22), (5, 12)]) == 17
    assert covered_us([(0, 4), (4, 6)]) == 6 and covered_us([]) == 0
