"""`DistributedContext`: rank, world size and device of this process, from torchrun's variables.

Under `torchrun --nproc_per_node N ...` (RANK, WORLD_SIZE, LOCAL_RANK set) the process group
starts with gloo on a CPU and nccl on a GPU; a plain run is rank 0 of a world of 1 and every
collective is a no-op.

Usage:
    context = DistributedContext.start("cpu")
    total = context.all_reduce_sum(torch.tensor([local_count]))
    context.barrier()
    context.stop()
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from eyas.engine.target import resolve_device


@dataclass
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    started_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def start(cls, device: str = "cpu") -> DistributedContext:
        """Join torchrun's process group when launched by it; pick this rank's device."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch_device = resolve_device(device)
        if torch_device.type == "cuda" and world_size > 1:
            torch_device = torch.device("cuda", local_rank)
            torch.cuda.set_device(torch_device)
        started = False
        if world_size > 1 and not dist.is_initialized():
            backend = "nccl" if torch_device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
            started = True
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, device=torch_device,
                   started_group=started)

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum of `tensor` over all ranks (a new tensor on the tensor's own device)."""
        if not self.is_distributed:
            return tensor.clone()
        reduced = tensor.detach().to(self.device).clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        return reduced.to(tensor.device)

    def broadcast_object(self, value: object) -> object:
        """Rank 0's `value` on every rank."""
        if not self.is_distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def stop(self) -> None:
        if self.started_group and dist.is_initialized():
            dist.destroy_process_group()
            self.started_group = False
