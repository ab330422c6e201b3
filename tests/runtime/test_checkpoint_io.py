import json
import random

import pytest
import torch

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.runtime.checkpoint import (
    CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from birkhoff.tasks.batches import batch_for_step
from birkhoff.tasks.problems import AdditionTask
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train import TrainConfig, build_optimizer, train_step

TRAIN = TrainConfig(lr=1e-3, warmup_steps=0)


def model_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=CharTokenizer().vocab_size, dim=32, num_layers=1, num_heads=2,
                num_streams=2, mtp_depth=1, max_seq_len=32)  # fmt: skip
    return ModelConfig(**(base | kw))


def trained(cfg: ModelConfig, steps: int = 2):
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(model, TRAIN)
    for s in range(steps):
        batch = batch_for_step(AdditionTask(2), CharTokenizer(), batch_size=4, seed=0, step=s)
        train_step(model, opt, batch, TRAIN, step=s)
    return model, opt


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so -0.0 vs 0.0 and NaN payloads would also count as different."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(bits(a[key]), bits(b[key])), key
        elif isinstance(a[key], dict):
            assert_same_state(a[key], b[key])
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_is_bit_identical(tmp_path, tie):
    model, opt = trained(model_cfg(tie_embeddings=tie))
    random.seed(123)
    torch.manual_seed(456)
    save_checkpoint(tmp_path / "ck", model, opt, step=2, extra={"note": "x"})
    expected_py, expected_torch = random.random(), torch.rand(3)

    model2 = Transformer(model_cfg(tie_embeddings=tie))
    opt2 = build_optimizer(model2, TRAIN)
    random.seed(0)
    loaded = load_checkpoint(tmp_path / "ck", model=model2, optimizer=opt2, restore_rng=True)
    assert random.random() == expected_py and torch.equal(torch.rand(3), expected_torch)
    assert loaded.step == 2 and loaded.extra == {"note": "x"} and loaded.config == model.cfg
    assert_same_state(model.state_dict(), model2.state_dict())
    assert_same_state(opt.state_dict(), opt2.state_dict())
    if tie:
        assert model2.lm_head.weight is model2.embed.weight
    # continuing from the checkpoint gives the same numbers as continuing the original
    batch = batch_for_step(AdditionTask(2), CharTokenizer(), batch_size=4, seed=0, step=9)
    m1 = train_step(model, opt, batch, TRAIN, step=2)
    m2 = train_step(model2, opt2, batch, TRAIN, step=2)
    assert m1 == m2
    assert_same_state(model.state_dict(), model2.state_dict())


def test_load_builds_the_model_from_config(tmp_path):
    model, _ = trained(model_cfg())
    save_checkpoint(tmp_path / "ck", model, step=7)
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.step == 7 and loaded.config == model.cfg
    assert_same_state(model.state_dict(), loaded.model.state_dict())
    with pytest.raises(CheckpointError, match=OPTIMIZER_FILE):
        load_checkpoint(tmp_path / "ck", optimizer=build_optimizer(loaded.model, TRAIN))


def test_overwrite_replaces_atomically_and_leaves_no_temp(tmp_path):
    model, opt = trained(model_cfg())
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    save_checkpoint(tmp_path / "ck", model, opt, step=2)
    assert load_checkpoint(tmp_path / "ck").step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")]


@pytest.fixture
def saved(tmp_path):
    model, opt = trained(model_cfg(), steps=1)
    return save_checkpoint(tmp_path / "ck", model, opt, step=1)


def test_truncated_file_is_named(saved):
    data = (saved / MODEL_FILE).read_bytes()
    (saved / MODEL_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{MODEL_FILE}.*truncated"):
        load_checkpoint(saved)


def test_corrupted_file_is_named(saved):
    data = bytearray((saved / OPTIMIZER_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (saved / OPTIMIZER_FILE).write_bytes(bytes(data))
    model = load_checkpoint(saved).model  # weights are fine
    with pytest.raises(CheckpointError, match=f"{OPTIMIZER_FILE}.*corrupted"):
        load_checkpoint(saved, model=model, optimizer=build_optimizer(model, TRAIN))


def test_missing_file_and_missing_manifest(saved):
    (saved / MODEL_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"{MODEL_FILE}: missing"):
        load_checkpoint(saved)
    (saved / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"{MANIFEST_FILE}: missing"):
        load_checkpoint(saved)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(saved.parent / "nope")


def rewrite_config(path, text: str) -> None:
    """Replace config.json and re-sign it, so only the config's *content* is wrong."""
    import hashlib

    (path / CONFIG_FILE).write_text(text)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    data = text.encode()
    manifest["files"][CONFIG_FILE] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_invalid_config_json(saved):
    rewrite_config(saved, "{not json")
    with pytest.raises(CheckpointError, match=f"{CONFIG_FILE}: invalid JSON"):
        load_checkpoint(saved)


def test_invalid_config_values(saved):
    cfg = json.loads((saved / CONFIG_FILE).read_text())
    rewrite_config(saved, json.dumps(cfg | {"num_heads": 3}))
    with pytest.raises(CheckpointError, match=f"{CONFIG_FILE}: invalid model config.*dim=32"):
        load_checkpoint(saved)
    rewrite_config(saved, json.dumps(cfg | {"layers": 3}))
    with pytest.raises(CheckpointError, match="unknown field"):
        load_checkpoint(saved)


def test_config_with_the_former_recompute_keys_loads_as_the_same_model(saved):
    # written while ModelConfig held the recompute policy (now TrainConfig.recompute / .reclaim)
    cfg = json.loads((saved / CONFIG_FILE).read_text())
    rewrite_config(saved, json.dumps(cfg | {"recompute": "full", "reclaim": "safe"}))
    model = Transformer(model_cfg())
    loaded = load_checkpoint(saved, model=model, optimizer=build_optimizer(model, TRAIN))
    assert loaded.config == model_cfg() and loaded.step == 1
    assert loaded.config == load_checkpoint(saved).model.cfg


def test_config_mismatch_with_given_model(saved):
    other = Transformer(model_cfg(dim=64))
    with pytest.raises(CheckpointError, match="config"):
        load_checkpoint(saved, model=other)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_extra_must_be_json(tmp_path):
    model, _ = trained(model_cfg(), steps=0)
    with pytest.raises(ValueError, match="extra="):
        save_checkpoint(tmp_path / "ck", model, step=0, extra={"t": torch.zeros(1)})
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_round_trip_from_cuda(tmp_path):
    torch.manual_seed(0)
    model = Transformer(model_cfg()).cuda()
    opt = build_optimizer(model, TRAIN)
    batch = batch_for_step(AdditionTask(2), CharTokenizer(), batch_size=4, seed=0, step=0)
    train_step(model, opt, batch.to("cuda"), TRAIN, step=0)
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    model2 = Transformer(model_cfg()).cuda()
    opt2 = build_optimizer(model2, TRAIN)
    load_checkpoint(tmp_path / "ck", model=model2, optimizer=opt2, restore_rng=True)
    assert_same_state(model.state_dict(), model2.state_dict())
    assert_same_state(opt.state_dict(), opt2.state_dict())
    assert all(s["exp_avg"].is_cuda for s in opt2.state.values())


def test_a_missing_directory_is_named_as_such(tmp_path) -> None:
    from birkhoff.runtime.checkpoint import CheckpointError, read_manifest

    with pytest.raises(CheckpointError, match="checkpoint directory does not exist"):
        read_manifest(tmp_path / "nope")
