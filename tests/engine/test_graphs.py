"""CUDA-graph steps: identical greedy tokens to the eager path, and refit safety.

The refit test runs on every device: generate, refit to other weights (several times, so the
refit's alternating buffer banks are reused), generate again, and compare with a fresh engine.
On CUDA it runs with graphs, whose captured weight addresses must follow every commit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from engine_helpers import tiny_config

from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.graphs import GraphPool, bucket
from birkhoff.engine.transfer import to_host
from birkhoff.model import Transformer
from birkhoff.refit.api import refit

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 0], [3, 5, 8, 13], [2, 9]]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_buckets() -> None:
    assert [bucket(n, 48) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    assert bucket(3, 100, smallest=32) == 32 and bucket(40, 50, smallest=32) == 50


def test_cuda_graphs_need_cuda() -> None:
    with pytest.raises(ValueError, match="cuda_graphs"):
        Engine(tiny_config(), cuda_graphs=True)
    assert Engine(tiny_config()).graphs is None  # off by default on CPU


class ReplayedGraph:
    """A CPU stand-in for a captured graph: replay reruns the step, which writes its outputs
    into the same static buffers a CUDA graph writes."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class EmulatedPool(GraphPool):
    """GraphPool whose capture is emulated: the bucketing, padding rows, static buffers, length
    buckets and output gathers of the graph path run on CPU exactly as on CUDA."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]:
        out = fn()  # the warm-up run, as on CUDA, where the capture itself runs nothing
        self.num_captured += 1
        return ReplayedGraph(fn), out


@pytest.mark.parametrize("k", [0, 2])
def test_graph_path_logic_equals_eager_on_cpu(trained_model: Transformer, k: int) -> None:
    """fp64, more prompts than rows, mixed lengths: every step goes through bucketed static
    shapes (rows padded to a power of two, keys to a length bucket) and gives eager's tokens."""
    model = copy.deepcopy(trained_model).double()
    eager = Engine.from_model(model, dtype=torch.float64, max_batch_size=4)
    graphed = Engine.from_model(model, dtype=torch.float64, max_batch_size=4)
    graphed.graphs = EmulatedPool(4, graphed.capacity, graphed.device)
    params = [  # later requests are shorter: the batch drains from its last rows; one filters
        SamplingParams(36 - 6 * i, temperature=float(i % 2), top_k=4 * (i == 3), seed=4,
                       num_speculative_tokens=k)
        for i in range(len(PROMPTS))
    ]  # fmt: skip
    out, ref = graphed.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    torch.testing.assert_close(
        [c.logprobs for c in out], [c.logprobs for c in ref], rtol=0, atol=1e-10
    )
    keys = {key for graphs in graphed.graphs.sets.values() for key in graphs}
    assert len({key[2] for key in keys}) >= 2 and len({key[3] for key in keys}) >= 2  # A', N'
    kinds = {key[0] for key in keys}  # every step, prefill and catch-up through a graph
    steps = {"speculative_step", "catch_up_step"} if k else {"plain_step"}
    assert kinds == steps | {"prefill_step"}
    assert {key[4] for key in keys} == {False, True}  # steps with and without a top-k row


def test_prefill_above_the_graph_budget_runs_eagerly_on_cpu(
    trained_model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill whose batch bucket x length bucket exceeds PREFILL_GRAPH_TOKENS runs eagerly
    (no prefill graph), inside an otherwise graphed generation, with eager's tokens."""
    from birkhoff.engine import decode

    model = copy.deepcopy(trained_model).double()
    eager = Engine.from_model(model, dtype=torch.float64, max_batch_size=4)
    graphed = Engine.from_model(model, dtype=torch.float64, max_batch_size=4)
    graphed.graphs = EmulatedPool(4, graphed.capacity, graphed.device)
    monkeypatch.setattr(decode, "PREFILL_GRAPH_TOKENS", 4 * 32 - 1)  # below any 4-row prefill
    params = mixed_params(0)
    out, ref = graphed.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    kinds = {key[0] for graphs in graphed.graphs.sets.values() for key in graphs}
    assert kinds == {"plain_step", "prefill_step"}  # later one-row admissions fit: graphed
    prefills = [key for g in graphed.graphs.sets.values() for key in g if key[0] == "prefill_step"]
    assert all(key[2] * key[3] <= 4 * 32 - 1 for key in prefills)


def test_speculative_steps_run_ahead_until_near_max_seq_len_on_cpu(
    trained_model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With static shapes a speculative step is queued before the previous one is read (the
    device advances n and the draft starts); rows that run into max_seq_len make the host read
    each step first. Tokens and logprobs equal the eager engine's, which reads every step."""
    from birkhoff.engine import decode

    model = copy.deepcopy(trained_model).double()
    eager = Engine.from_model(model, dtype=torch.float64, max_batch_size=4)
    graphed = Engine.from_model(model, dtype=torch.float64, max_batch_size=4)
    graphed.graphs = EmulatedPool(4, graphed.capacity, graphed.device)
    ahead: list[bool] = []
    queue = decode.Generation.queue_speculative_step

    def counted(self, rows, pending):  # type: ignore[no-untyped-def]
        ahead.append(pending is not None)
        return queue(self, rows, pending)

    monkeypatch.setattr(decode.Generation, "queue_speculative_step", counted)
    params = [SamplingParams(200 if i < 2 else 9, temperature=float(i % 2), seed=7,
                             num_speculative_tokens=3) for i in range(len(PROMPTS))]  # fmt: skip
    out = graphed.generate(PROMPTS, params)
    assert any(ahead) and not all(ahead)  # ahead, and read-first near the end
    ref = eager.generate(PROMPTS, params)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert [c.finish_reason for c in out][:2] == ["length", "length"]
    assert len(PROMPTS[0]) + len(out[0].tokens) == graphed.max_seq_len
    torch.testing.assert_close(
        [c.logprobs for c in out], [c.logprobs for c in ref], rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("device", DEVICES)
def test_one_engine_serves_every_draft_count(trained_model: Transformer, device: str) -> None:
    """One engine's calls with 1, then 3, then 2, then 0 drafts each give the tokens of a fresh
    engine that served only that count: a step's graph depends on its draft count (its output
    has 1 + 2(J + 1) columns), so a call never replays another count's graphs (on CPU the
    emulated pool; on CUDA real graphs in both engines)."""
    model = copy.deepcopy(trained_model).double().to(device)
    dtype = torch.float64 if device == "cpu" else torch.float32
    engine = Engine.from_model(model, device=device, dtype=dtype, max_batch_size=4,
                               cuda_graphs=device == "cuda", max_speculative_tokens=3)  # fmt: skip
    if device == "cpu":
        engine.graphs = EmulatedPool(4, engine.capacity, engine.device)
    for k in (1, 3, 2, 0):
        fresh = Engine.from_model(model, device=device, dtype=dtype, max_batch_size=4,
                                  max_speculative_tokens=3)  # fmt: skip
        params = SamplingParams(12, num_speculative_tokens=k)
        out, ref = engine.generate(PROMPTS, params), fresh.generate(PROMPTS, params)
        assert [c.tokens for c in out] == [c.tokens for c in ref], k
    assert engine.graphs is not None
    keys = {key for graphs in engine.graphs.sets.values() for key in graphs}
    assert {key[-1] for key in keys if key[0] == "speculative_step"} == {1, 2, 3}


def test_graph_sets_follow_the_refit_banks_on_cpu(trained_model: Transformer) -> None:
    """Emulated graphs over refits whose tensors live in the two alternating buffer banks: a
    graph set is reused when a commit puts new weights at its captured addresses, and every
    generate equals a fresh engine's."""
    models = [copy.deepcopy(trained_model)] + [perturbed(trained_model, s) for s in (1, 2, 3)]
    engine = Engine.from_model(models[0], max_batch_size=4)
    engine.graphs = EmulatedPool(4, engine.capacity, engine.device)
    params = mixed_params(2)
    sets_seen = []
    for model in models[1:] * 2:
        refit(model, engine, bucket_bytes=1 << 20)  # no tensor spans buckets: served from banks
        out = engine.generate(PROMPTS, params)
        ref = Engine.from_model(model, max_batch_size=4).generate(PROMPTS, params)
        assert [c.tokens for c in out] == [c.tokens for c in ref]
        sets_seen.append(next(reversed(engine.graphs.sets)))
    assert len(set(sets_seen)) == 2  # two banks, two graph sets, each reused with new weights
    captured = engine.graphs.num_captured
    refit(models[1], engine, bucket_bytes=1 << 20)
    engine.generate(PROMPTS, params)
    assert engine.graphs.num_captured == captured  # a later refit captures nothing new


def perturbed(model: Transformer, seed: int) -> Transformer:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen).to(p))
    return other


def mixed_params(k: int) -> list[SamplingParams]:
    return [
        SamplingParams(4 + 3 * i, temperature=float(i % 2), seed=1, num_speculative_tokens=k)
        for i in range(len(PROMPTS))
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_refit_then_generate_equals_a_fresh_engine(trained_model: Transformer, device: str) -> None:
    models = [copy.deepcopy(trained_model)] + [perturbed(trained_model, s) for s in (1, 2)]
    models = [m.to(device) for m in models]
    engine = Engine.from_model(models[0], device=device, max_batch_size=4)
    for k in (0, 2):
        refit(models[0], engine, bucket_bytes=1 << 12)
        before = engine.generate(PROMPTS, mixed_params(k))
        for step, model in enumerate([models[1], models[2], models[1], models[2]]):
            refit(model, engine, bucket_bytes=1 << 12)
            out = engine.generate(PROMPTS, mixed_params(k))
            fresh = Engine.from_model(model, device=device, max_batch_size=4, cuda_graphs=False)
            ref = fresh.generate(PROMPTS, mixed_params(k))
            assert [c.tokens for c in out] == [c.tokens for c in ref], (k, step)
            torch.testing.assert_close(
                [c.logprobs for c in out], [c.logprobs for c in ref], rtol=0, atol=1e-4
            )
            assert {c.weight_version for c in out} == {engine.weight_version}
        assert [c.tokens for c in before] != [c.tokens for c in out]
    if engine.graphs is not None:
        assert engine.graphs.num_captured > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize(
    ("dtype", "streams"),
    [(torch.float32, 1), (torch.float32, 2), (torch.float32, 4), (torch.bfloat16, 2)],
)
def test_graph_steps_give_the_eager_greedy_tokens(
    trained_model: Transformer, dtype: torch.dtype, k: int, streams: int
) -> None:
    """Identical greedy tokens (bf16: on the trained model, whose argmax margins are wide;
    graphs attend over a length bucket and pad rows to a batch bucket, so the kernels may round
    differently), logprobs close, more prompts than rows; a second call only replays."""
    torch.manual_seed(0)
    model = trained_model if streams == 2 else Transformer(tiny_config(num_streams=streams))
    model = copy.deepcopy(model).cuda()
    kwargs = dict(device="cuda", dtype=dtype, max_batch_size=4)
    graphed = Engine.from_model(model, cuda_graphs=True, **kwargs)  # type: ignore[arg-type]
    eager = Engine.from_model(model, cuda_graphs=False, **kwargs)  # type: ignore[arg-type]
    params = [SamplingParams(6 + 5 * i, num_speculative_tokens=k) for i in range(len(PROMPTS))]
    out, ref = graphed.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    atol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(
        [c.logprobs for c in out], [c.logprobs for c in ref], rtol=0, atol=atol
    )
    assert graphed.graphs is not None and graphed.graphs.num_captured > 0
    captured = graphed.graphs.num_captured
    assert [c.tokens for c in graphed.generate(PROMPTS, params)] == [c.tokens for c in ref]
    assert graphed.graphs.num_captured == captured  # the second call only replays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_queued_plain_steps_never_wait_for_the_device(
    trained_model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain step is queued while the previous one runs: building its chunk, replaying its
    graph and sampling must not synchronise with the device (torch's sync debug mode raises on
    any synchronising call, e.g. a pageable host-to-device copy)."""
    from birkhoff.engine import decode

    engine = Engine.from_model(copy.deepcopy(trained_model).cuda(), device="cuda", max_batch_size=4)
    params = [SamplingParams(12 + 5 * i, temperature=float(i % 2), seed=3) for i in range(6)]
    engine.generate(PROMPTS, params)  # capture the graphs first (capture synchronises)
    queue, queued = decode.Generation.queue_plain_step, []

    def checked(self: decode.Generation, rows: list[int]) -> decode.PlainStep:
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = queue(self, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        queued.append(len(rows))
        return step

    monkeypatch.setattr(decode.Generation, "queue_plain_step", checked)
    out = engine.generate(PROMPTS, params)
    assert len(queued) >= 12 and all(c.tokens for c in out)


def test_host_copy_reads_the_values_of_its_time() -> None:
    t = torch.tensor([[3, 1], [4, 1]])
    copied = to_host(t)
    assert copied.tolist() == [[3, 1], [4, 1]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copy_waits_for_its_step_not_for_the_next() -> None:
    """collect() reads step t while step t+1 runs: the copy must not wait for work queued
    after it (a plain `.tolist()` would wait for the sleep below, ~0.5 s)."""
    t = torch.arange(6, device="cuda").view(3, 2) * 2
    copied = to_host(t)
    torch.cuda._sleep(1_000_000_000)  # the next step: ~0.5 s of device time
    assert copied.tolist() == [[0, 2], [4, 6], [8, 10]]
    assert not torch.cuda.current_stream().query()  # read while the later work still runs
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_speculative_steps_sync_only_to_read_their_result(
    trained_model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A speculative step (drafts, verify, acceptance, sampling with and without top-k/top-p)
    is one replayed graph: queueing it (state, replay, the copy of its result) must not
    synchronise, also while the step before it runs; only reading a result does."""
    from birkhoff.engine import decode

    engine = Engine.from_model(copy.deepcopy(trained_model).cuda(), device="cuda", max_batch_size=4)
    params = [
        SamplingParams(12 + 5 * i, temperature=float(i % 2), top_k=3 * (i % 3), seed=3,
                       num_speculative_tokens=2)
        for i in range(6)
    ]  # fmt: skip
    engine.generate(PROMPTS, params)  # capture the graphs first (capture synchronises)
    queue, ahead = decode.Generation.queue_speculative_step, []

    def checked(self, rows, pending):  # type: ignore[no-untyped-def]
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = queue(self, rows, pending)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ahead.append(pending is not None)
        return step

    monkeypatch.setattr(decode.Generation, "queue_speculative_step", checked)
    captured = engine.graphs.num_captured if engine.graphs is not None else -1
    out = engine.generate(PROMPTS, params)
    assert len(ahead) >= 6 and sum(ahead) >= 3 and all(c.tokens for c in out)
    assert engine.graphs is not None and engine.graphs.num_captured == captured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_heads_attention_gives_the_per_head_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The several-heads decode attention (which large batches take), on here at every batch:
    plain steps give the per-head kernel's greedy tokens in fp32 (speculative steps run their
    drafts and verify over several positions a row, which it does not serve)."""
    from birkhoff.kernels import attention

    torch.manual_seed(0)
    model = Transformer(tiny_config(num_kv_heads=4)).cuda()  # H = G: the kernel's case
    params = [SamplingParams(6 + 5 * i) for i in range(len(PROMPTS))]
    launched, kernel = [], attention.decode_attention_heads

    class Counted:  # the kernel, counting its launches
        def __getitem__(self, grid: tuple[int, int]) -> Callable[..., None]:
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attention, "decode_attention_heads", Counted())
    runs = []
    for heads in (dict(attention.HEADS, PAIRS=0), dict(attention.HEADS, HB=0)):
        monkeypatch.setattr(attention, "HEADS", heads)
        engine = Engine.from_model(model, device="cuda", dtype=torch.float32, max_batch_size=4)
        runs.append(engine.generate(PROMPTS, params))
    assert launched  # (the per-head run launches it never: HB 0)
    assert [c.tokens for c in runs[0]] == [c.tokens for c in runs[1]]
    torch.testing.assert_close(
        [c.logprobs for c in runs[0]], [c.logprobs for c in runs[1]], rtol=0, atol=1e-4
    )
