"""Run a function on N CPU ranks over gloo, as torchrun would: one forked process per rank.

Processes are forked (not spawned) so they start in well under a second with torch already
imported; each sets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*), joins
the group through `birkhoff.runtime.distributed.init_distributed` and runs on one thread. An
exception on any rank fails the calling test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

# imported before forking, so the ranks start warm (FSDP2 imports torch._dynamo lazily)
import torch
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.multiprocessing as mp

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    from birkhoff.runtime.distributed import init_distributed

    init_distributed("cpu", "gloo")
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2) -> None:
    """`fn(rank, *args)` on `world` gloo ranks; returns when all finished, raises if one failed."""
    mp.start_processes(_rank_main, args=(world, free_port(), fn, args), nprocs=world,
                       start_method="fork")  # fmt: skip
