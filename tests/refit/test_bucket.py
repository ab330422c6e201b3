"""Buckets: placement (size limit, alignment, groups, chunks), bit-exact reassembly in any order."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from refit_helpers import pack_buckets, unpack_buckets

from birkhoff.refit.bucket import ALIGN, Assembler, BucketEntry, place

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8,
          torch.float8_e4m3fn, torch.bool]  # fmt: skip


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype in (torch.int64, torch.uint8):
        return torch.randint(0, 200, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


tensor_specs = st.lists(
    st.tuples(
        st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=8,
)


@given(specs=tensor_specs, bucket_bytes=st.integers(16, 2000), seed=st.integers(0, 1000))
@settings(max_examples=80, deadline=None)
def test_round_trip_any_bucket_size_any_order(
    specs: list[tuple[tuple[int, ...], torch.dtype]], bucket_bytes: int, seed: int
) -> None:
    named = [(f"t{i}", make_tensor(shape, dt, seed + i)) for i, (shape, dt) in enumerate(specs)]
    buckets = list(pack_buckets(named, bucket_bytes, device="cpu"))
    for bucket in buckets:
        assert bucket.entries and bucket.nbytes <= bucket_bytes
        for e in bucket.entries:
            assert e.offset % ALIGN == 0 and e.offset + e.nbytes <= bucket.nbytes
    random.Random(seed).shuffle(buckets)
    out = unpack_buckets(buckets)
    assert sorted(out) == sorted(n for n, _ in named)
    for name, tensor in named:
        assert same_bits(out[name], tensor), name


def test_large_tensor_is_split_and_each_bucket_is_full() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    buckets = list(pack_buckets([("w", t)], 64, device="cpu"))
    assert len(buckets) == 4000 // 64 + 1
    assert all(b.nbytes == 64 for b in buckets[:-1])
    assert [e.chunk_offset for b in buckets for e in b.entries] == list(range(0, 4000, 64))
    assert torch.equal(unpack_buckets(buckets)["w"], t)


def test_a_group_stays_in_one_bucket_unless_larger_than_a_bucket() -> None:
    f32 = torch.float32
    codes, scales = ("w", torch.float8_e4m3fn, (8, 8)), ("w_scale_inv", f32, (1, 1))
    # after 40 bytes of "a" the codes would end at 48 + 64 > 100: the group opens a new bucket
    buckets = place([[("a", f32, (10,))], [codes, scales]], 100)
    assert [[e.name for e in b] for b in buckets] == [["a"], ["w", "w_scale_inv"]]
    assert buckets[1][1].offset == 64  # aligned after the codes
    # larger than a bucket: chunks in buckets of their own, then a fresh bucket
    buckets = place([[codes, scales], [("b", f32, (2,))]], 48)
    assert [[(e.name, e.chunk_offset) for e in b] for b in buckets] == [
        [("w", 0)], [("w", 48), ("w_scale_inv", 0)], [("b", 0)]]  # fmt: skip


def entry(name: str, lo: int, hi: int, total: int = 16) -> BucketEntry:
    return BucketEntry(name, torch.float32, (total // 4,), 0, hi - lo, lo, total)


def test_assembler_records_overlap_gap_and_inconsistency_without_overwriting() -> None:
    asm = Assembler("cpu")
    ones, twos = torch.ones(8, dtype=torch.uint8), torch.full((8,), 2, dtype=torch.uint8)
    asm.add(entry("a", 0, 8), ones)
    asm.add(entry("a", 4, 12), twos[:8])  # overlaps [0, 8): duplicate, not written
    asm.add(entry("a", 8, 16), ones)
    assert asm.duplicated == {"a"} and asm.tensors["a"].view(torch.uint8).eq(1).all()
    asm.add(entry("b", 0, 8), ones)  # never gets its second half
    assert asm.incomplete() == {"b"}
    asm.add(BucketEntry("c", torch.float32, (4,), 0, 8, 0, 16), ones)
    asm.add(BucketEntry("c", torch.float16, (8,), 0, 8, 8, 16), ones)  # disagrees on dtype
    assert asm.inconsistent == {"c"}


def test_unpack_rejects_duplicates() -> None:
    buckets = list(pack_buckets([("w", torch.randn(3)), ("w", torch.randn(3))], 64, device="cpu"))
    with pytest.raises(ValueError, match="'w'"):
        unpack_buckets(buckets)
