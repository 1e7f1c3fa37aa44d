"""A 2-process gloo check of mmpipe.model.moe.AllToAll (tests/test_moe.py spawns it): its output and input
gradient equal the deprecated torch.distributed.nn.functional.all_to_all_single's on uneven splits, and it raises
no FutureWarning. Kept apart from the test module so that a spawned process imports only torch and mmpipe's MoE."""
from __future__ import annotations

import os
import warnings


def check(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.nn.functional import all_to_all_single

    from mmpipe.model.moe import AllToAll
    g = torch.Generator().manual_seed(rank)
    send, recv = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])  # rank 0 sends 1 row to itself, 3 to rank 1
    x = torch.randn(sum(send), 4, generator=g, requires_grad=True)
    w = torch.randn(sum(recv), 4, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = AllToAll.apply(x, recv, send, dist.group.WORLD)
        (y * w).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the reference is the deprecated call
        y2 = all_to_all_single(x2.new_empty(sum(recv), 4), x2, recv, send)
    (y2 * w).sum().backward()
    future = [str(c.message) for c in caught if issubclass(c.category, FutureWarning)]
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{list(y.shape)} {torch.equal(y, y2)} {torch.equal(x.grad, x2.grad)} {future}\n")
    dist.barrier()  # neither leaves while the other still talks
    dist.destroy_process_group()
