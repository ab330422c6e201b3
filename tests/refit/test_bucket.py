"""Buckets: size limit, alignment, chunking across buckets, bit-exact reassembly in any order."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from birkhoff.refit.bucket import (
    ALIGN,
    Assembler,
    BucketEntry,
    BucketPacker,
    pack_buckets,
    unpack_bucket,
    unpack_buckets,
)

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
    out = dict(unpack_buckets(buckets, device="cpu"))
    assert sorted(out) == sorted(n for n, _ in named)
    for name, tensor in named:
        assert same_bits(out[name], tensor), name


def test_large_tensor_is_split_and_each_bucket_is_full() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    buckets = list(pack_buckets([("w", t)], 64, device="cpu"))
    assert len(buckets) == 4000 // 64 + 1
    assert all(b.nbytes == 64 for b in buckets[:-1])
    assert [e.chunk_offset for b in buckets for e in b.entries] == list(range(0, 4000, 64))
    assert torch.equal(dict(unpack_buckets(buckets, device="cpu"))["w"], t)


def test_parts_are_packed_as_their_concatenation_with_fused_cast() -> None:
    parts = [torch.randn(3, 5), torch.randn(2, 5), torch.randn(4, 5)]
    packer = BucketPacker(48, device="cpu")
    buckets = [*packer.add("fused", parts, torch.bfloat16), *packer.flush()]
    out = dict(unpack_buckets(buckets, device="cpu"))["fused"]
    assert same_bits(out, torch.cat(parts).to(torch.bfloat16))


def test_reused_buffers_cycle_and_stay_valid_when_consumed_in_time() -> None:
    t = torch.randn(100)
    packer = BucketPacker(64, device="cpu", num_buffers=2)
    asm, ptrs = Assembler("cpu"), set()
    for bucket in itertools.chain(packer.add("w", [t], torch.float32), packer.flush()):
        ptrs.add(bucket.buffer.untyped_storage().data_ptr())
        for entry, chunk in unpack_bucket(bucket):  # consumed before the next bucket is packed
            asm.add(entry, chunk)
    assert len(ptrs) == 2
    assert torch.equal(asm.tensors["w"], t) and not asm.incomplete()


def entry(name: str, lo: int, hi: int, total: int = 16) -> BucketEntry:
    return BucketEntry(name, torch.float32, (total // 4,), 0, hi - lo, lo, total)


def test_assembler_records_overlap_gap_and_inconsistency_without_overwriting() -> None:
    asm = Assembler("cpu")
    ones, twos = torch.ones(8, dtype=torch.uint8), torch.full((8,), 2, dtype=torch.uint8)
    assert not asm.add(entry("a", 0, 8), ones)
    assert not asm.add(entry("a", 4, 12), twos[:8])  # overlaps [0, 8): duplicate, not written
    assert asm.add(entry("a", 8, 16), ones)
    assert asm.duplicated == {"a"} and asm.tensors["a"].view(torch.uint8).eq(1).all()
    asm.add(entry("b", 0, 8), ones)  # never gets its second half
    assert asm.incomplete() == {"b"}
    asm.add(BucketEntry("c", torch.float32, (4,), 0, 8, 0, 16), ones)
    asm.add(BucketEntry("c", torch.float16, (8,), 0, 8, 8, 16), ones)  # disagrees on dtype
    assert asm.inconsistent == {"c"}


def test_unpack_rejects_duplicates() -> None:
    buckets = list(pack_buckets([("w", torch.randn(3)), ("w", torch.randn(3))], 64, device="cpu"))
    with pytest.raises(ValueError, match="'w'"):
        list(unpack_buckets(buckets, device="cpu"))


@pytest.mark.parametrize("bad", [0, 15, 16.0, None])
def test_bucket_bytes_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketPacker(bad, device="cpu")  # type: ignore[arg-type]
