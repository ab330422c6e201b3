"""The MTP reclaim bug on our own model (S=4, M=1, full recompute), and safe reclaim's parity.

The MTP checkpoint's input is the decoder's multistream tensor, whose storage the output
contraction also saved. MTP's backward runs first; freeing its input unconditionally makes the
contraction's backward read freed memory.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.recompute import UseAfterFreeError, census, sanitize, track_saved_storages
from birkhoff.train.recompute import apply_recompute

CFG = ModelConfig(
    vocab_size=64, dim=32, num_layers=2, num_heads=4, num_streams=4, mtp_depth=1, max_seq_len=16
)


def loss_and_grads(
    cfg: ModelConfig, reclaim: str | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    if reclaim is not None:
        apply_recompute(model, reclaim=reclaim)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with track_saved_storages():
        out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("reclaim", ["safe", "never"])
def test_full_recompute_is_identical_in_fp64(reclaim: str) -> None:
    ref_loss, ref_grads = loss_and_grads(CFG)
    with sanitize():
        loss, grads = loss_and_grads(CFG, reclaim)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert g is not None and torch.equal(grads[name], g), name


def test_safe_reclaims_every_checkpoint_input_and_leaks_nothing() -> None:
    torch.manual_seed(0)
    model = apply_recompute(Transformer(CFG).double(), reclaim="safe")
    ids = torch.randint(0, CFG.vocab_size, (2, 12))
    with track_saved_storages() as registry:
        out = model(ids, labels=ids)
    out.loss.backward()
    # embedding -> layers.0, layers.0 -> layers.1, multistream and Emb(t+1) -> mtp.0
    assert sorted(registry.freed.values()) == ["layers.0", "layers.1", "mtp.0", "mtp.0"]
    del out
    assert census().live_bytes == 0


def test_always_reclaim_is_caught_at_the_output_contraction() -> None:
    torch.manual_seed(0)
    model = apply_recompute(Transformer(CFG).double(), reclaim="always")
    ids = torch.randint(0, CFG.vocab_size, (2, 12))
    with sanitize(), pytest.raises(UseAfterFreeError) as err:
        with track_saved_storages():
            out = model(ids, labels=ids)
        out.loss.backward()
    assert err.value.scope == "contraction"  # a node saved by the output contraction's forward
    assert err.value.freed_by == "mtp.0"
    assert "Backward" in err.value.node


SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.recompute.test_model_reclaim import CFG, loss_and_grads
    ref_loss, ref = loss_and_grads(CFG)
    print("REFERENCE_OK", flush=True)
    loss, got = loss_and_grads(CFG, "always")
    same = torch.equal(loss, ref_loss) and all(torch.equal(got[n], g) for n, g in ref.items())
    print("IDENTICAL" if same else "DIFFERENT")
    """
)


def test_always_reclaim_corrupts_gradients_without_the_sanitizer() -> None:
    # Reading freed memory may crash the interpreter, so it runs in a child process.
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=_repo_root())  # fmt: skip
    assert "REFERENCE_OK" in proc.stdout, proc.stderr[-2000:]  # the setup itself worked
    assert "IDENTICAL" not in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode != 0 or "DIFFERENT" in proc.stdout, proc.stderr[-2000:]


def _repo_root() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[2])
