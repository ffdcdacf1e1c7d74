"""rtkernels.dist: attention across GPUs - ring, striped and zigzag attention over NCCL.

>>> import rtkernels.dist as rd
>>> q, k, v = (rd.shard(x, rank, world, "striped") for x in (q_full, k_full, v_full))
>>> o, lse = rd.ring_attention(q, k, v, causal=True, layout="striped", return_lse=True)
>>> dq, dk, dv = rd.ring_attention_backward(do, q, k, v, o, lse, causal=True, layout="striped")

Each rank holds a shard of the sequence (:mod:`.layout`), K/V blocks travel around the ring
(:mod:`.schedule`, :mod:`.ring`) over a communicator (:mod:`.comm`: NCCL through CuPy, a torch
process group, or simulated ranks in one process).  Start one process per GPU with
``python -m rtkernels.dist.run -n 2 script.py`` or torchrun.

Importing this package needs neither a GPU nor torch.
"""
from .comm import Comm, NcclComm, Pending, SimulatedComm, SingleComm, TorchComm, default_comm
from .layout import LAYOUTS, positions, shard, unshard
from .ring import ring_attention, ring_attention_backward
from .schedule import Block, plan

__all__ = ["ring_attention", "ring_attention_backward", "shard", "unshard", "positions", "LAYOUTS", "plan", "Block",
           "Comm", "NcclComm", "TorchComm", "SimulatedComm", "SingleComm", "Pending", "default_comm"]
