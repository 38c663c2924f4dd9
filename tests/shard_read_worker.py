"""Run by tests/test_shard_load.py, one process per rank (gloo, 2 ranks): FSDP2 over a tiny MoE
built on the meta device, its shards read by :func:`gspo.model.shard_load.load_own_shards` with
safetensors' reads recorded; writes the names this rank read and its shards to ``OUT/rank{r}.pt``.

    python tests/shard_read_worker.py RANK WORLD PORT FOLDER OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import safetensors
import torch
import torch.distributed as dist

torch.set_num_threads(1)


def _recording(opened: list[str]):
    real = safetensors.safe_open

    class Recorded:
        def __init__(self, *args, **kwargs):
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            opened.append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name):
            opened.append(name)
            return self.f.get_slice(name)

    return Recorded


def main() -> None:
    rank, world, port, folder, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        Path(sys.argv[4]),
        Path(sys.argv[5]),
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from gspo.compat import transformers_model
    from gspo.model import shard_load

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    transformers_model.init_buffers(model)
    opened: list[str] = []
    safetensors.safe_open = _recording(opened)
    shard_load.load_own_shards(model, folder)
    local = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    torch.save({"opened": opened, "local": local}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
