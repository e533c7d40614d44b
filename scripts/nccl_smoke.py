"""Two-GPU NCCL check without tokenmill: an all-reduce, eager and captured in a CUDA graph. Run by
scripts/gpu_check.sh (section tp) before the TP tests, so a hang there is told apart from one in tokenmill.
    python -m torch.distributed.run --nproc-per-node 2 scripts/nccl_smoke.py"""
import os

import torch
import torch.distributed as dist

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
x = torch.full((4,), float(rank + 1), device="cuda")
dist.all_reduce(x)
assert x.tolist() == [3.0] * 4, x
graph, y = torch.cuda.CUDAGraph(), torch.ones(4, device="cuda")
torch.cuda.synchronize()
with torch.cuda.graph(graph):
    dist.all_reduce(y)
graph.replay()
torch.cuda.synchronize()
assert y.tolist() == [2.0] * 4, y
print(f"rank {rank}: NCCL all-reduce ok, eager and in a CUDA graph", flush=True)
graph.reset()  # leaving the group with a graph that captured its all-reduce hangs (pytorch/pytorch#115388)
dist.destroy_process_group()
print(f"rank {rank}: left the group", flush=True)
