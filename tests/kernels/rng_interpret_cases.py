"""Fused splitmix64 uniforms, per-row sampling and a plain step's inputs against the eager
reference under the Triton interpreter on CPU (run by test_mhc_interpret.py in a fresh
process)."""

from __future__ import annotations

import os

import pytest
from accept_cases import ACCEPT_CASES, check_verify_accept
from rng_cases import SIZES, check_request_random, check_uniform_bits
from sample_cases import (
    NEXT_CASES,
    SAMPLE_CASES,
    check_sample_edges,
    check_sample_next,
    check_sample_rows,
)
from step_inputs_cases import (
    DEPTH_CASES,
    INPUT_CASES,
    check_chunk_inputs,
    check_chunk_inputs_errors,
    check_depth_inputs,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


@pytest.mark.parametrize("size", SIZES)
def test_uniform_bits_equal_eager(size: int) -> None:
    check_uniform_bits("cpu", size)


def test_request_random_fused_equals_eager() -> None:
    check_request_random("cpu")


@pytest.mark.parametrize("case", SAMPLE_CASES, ids=str)
def test_sample_rows_match_eager(case: tuple) -> None:
    check_sample_rows("cpu", case)


def test_sample_rows_edges_and_errors() -> None:
    check_sample_edges("cpu")


@pytest.mark.parametrize("case", NEXT_CASES, ids=str)
def test_sample_next_equals_the_launches_it_replaces(case: tuple) -> None:
    check_sample_next("cpu", *case)


@pytest.mark.parametrize("case", INPUT_CASES, ids=str)
def test_chunk_inputs_equal_the_eager_ops(case: tuple) -> None:
    check_chunk_inputs("cpu", case)


def test_chunk_inputs_errors() -> None:
    check_chunk_inputs_errors("cpu")


@pytest.mark.parametrize("case", DEPTH_CASES, ids=str)
def test_depth_inputs_equal_the_eager_ops(case: tuple) -> None:
    check_depth_inputs("cpu", case)


@pytest.mark.parametrize("case", ACCEPT_CASES, ids=str)
def test_verify_accept_equals_the_launches_it_replaces(case: tuple) -> None:
    check_verify_accept("cpu", *case)
