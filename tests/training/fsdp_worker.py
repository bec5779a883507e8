"""Run by test_fsdp.py under `torchrun --nproc_per_node 2` (gloo, CPU): each memlm model is sharded with FSDP2 the
way Accelerate's TRANSFORMER_BASED_WRAP does it (every module whose class is in `_no_split_modules`, then the
root), each rank takes half of a batch, and the gathered gradients are written out for the test to compare with
one process on the whole batch."""

import datetime
import os
import sys

import torch
import torch.distributed as distributed
from torch.distributed.fsdp import fully_shard

from tests.training.test_fsdp import build_models, fixed_batch


def main(output: str) -> None:
    # Bounded: a rank that waits for a peer gives up after 4 minutes with an error instead of hanging the test.
    distributed.init_process_group("gloo", timeout=datetime.timedelta(minutes=4))
    try:
        rank, world = distributed.get_rank(), distributed.get_world_size()
        gradients = {}
        for name, model in build_models().items():
            for module in model.modules():
                if type(module).__name__ in model._no_split_modules:
                    fully_shard(module)
            fully_shard(model)
            input_ids = fixed_batch().chunk(world)[rank]
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            gradients[name] = {key: parameter.grad.full_tensor() for key, parameter in model.named_parameters()}
            print(f"rank {rank}: {name} done", flush=True)  # where a rank stopped, should one abort
        if rank == 0:
            torch.save(gradients, output)
        # Both ranks leave together: a rank that tore down its side of gloo's connections while the other was still
        # busy (rank 0 writing under load) aborted once at exit ("terminate called without an active exception").
        distributed.barrier()
    finally:
        # Every rank, also after an error: a process group never destroyed aborts the process at exit as well.
        distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    print("left the process group", flush=True)
    # Out without the interpreter's and libtorch's teardown, where a thread still joinable aborts a process: a rank
    # aborted once more despite the barrier and destroy_process_group ("terminate called without an active exception",
    # CI of stop 62; where it was is not known: the lines above now say how far each rank got).
    sys.stderr.flush()
    os._exit(0)
