"""Ring attention across GPUs over NCCL (skips with fewer than 2 GPUs).

pytest launches this file as a script through the launcher, one process per GPU (2 by default;
``RTKERNELS_TEST_RANKS=n`` for more):

    python -m rtkernels.dist.run -n 2 tests/test_ring_multigpu.py            # CuPy NCCL, env bootstrap
    python -m rtkernels.dist.run -n 2 tests/test_ring_multigpu.py --torch    # a torch.distributed group

Every rank draws the same full sequence (one seed for all), runs its shard through
ring_attention / ring_attention_backward and checks it against the float64 reference, the reference
in the input dtype and single-GPU rtk on the full sequence (the rule of tests/test_ring_gpu.py),
for every layout, causal and not, head dims 64 / 128 / 192, GQA, float16 and bfloat16.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = [  # (layout, causal, head_dim, local length, nheads, nheads_kv, dtype)
    ("striped", True, 128, 74, 4, 2, "bfloat16"),
    ("zigzag", True, 128, 74, 4, 2, "bfloat16"),
    ("contiguous", True, 128, 74, 4, 2, "float16"),
    ("striped", False, 128, 74, 4, 2, "float16"),
    ("zigzag", False, 64, 300, 4, 1, "bfloat16"),
    ("contiguous", False, 64, 130, 2, 2, "bfloat16"),
    ("striped", True, 192, 96, 4, 2, "bfloat16"),
    ("zigzag", True, 192, 42, 2, 1, "float16"),
    ("contiguous", True, 64, 258, 4, 4, "bfloat16"),
]


def _gpus() -> int:
    from rtkernels import device
    return device.gpu_count()


def _launch(extra_args=(), ranks=None):
    n = ranks or int(os.environ.get("RTKERNELS_TEST_RANKS", "2"))
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs, {_gpus()} visible")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               RTKERNELS_TEST_SEED=str(int(np.random.SeedSequence().entropy % 2 ** 32)))
    print(f"seed={env['RTKERNELS_TEST_SEED']}")
    r = subprocess.run([sys.executable, "-m", "rtkernels.dist.run", "-n", str(n), "--timeout", "900",
                        os.path.abspath(__file__), *extra_args], env=env, capture_output=True, text=True)
    print(r.stdout[-20000:])
    print(r.stderr[-20000:], file=sys.stderr)
    assert r.returncode == 0, f"ranks failed (exit {r.returncode}); see the output above"


@pytest.mark.gpu
def test_multigpu_ring_over_cupy_nccl():
    from cupy.cuda import nccl
    if not nccl.available:
        pytest.skip("CuPy's NCCL binding is not available")
    _launch()


@pytest.mark.gpu
def test_multigpu_ring_over_torch_process_group():
    pytest.importorskip("torch")
    _launch(("--torch",))


# ---- one rank (run by the launcher) -----------------------------------------------------------------
def rank_main(argv) -> int:
    import cupy as cp
    sys.path.insert(0, HERE)
    import rtkernels.dist as rd
    from gpu_util import random_array
    from test_ring_gpu import check_ring

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    cp.cuda.Device(local).use()
    comm = None   # rd.default_comm(): NCCL from the environment, or torch's group once initialized
    if "--torch" in argv:
        import torch
        import torch.distributed as dist
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        comm = dist.group.WORLD
    seed = int(os.environ.get("RTKERNELS_TEST_SEED", "1234"))
    failures = []
    for i, (layout, causal, d, L, H, Hkv, dtype) in enumerate(CASES):
        rng = np.random.default_rng(seed + i)   # the same full sequence on every rank
        S, B = world * L, 2
        q, k, v, do = (random_array(rng, (B, S, h, d), dtype)[0] for h in (H, Hkv, Hkv, H))
        part = lambda x, dim: rd.shard(x, rank, world, layout, dim=dim)   # noqa: E731
        qs, ks, vs, dos = (part(x, 1) for x in (q, k, v, do))
        extra = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        scale = 1.0 / np.sqrt(d)
        tag = f"rank {rank}/{world} [{'torch' if comm is not None else 'nccl'}] {layout} causal={causal} d={d} " \
              f"L={L} H={H}/{Hkv} {dtype}"
        try:
            o, lse = rd.ring_attention(qs, ks, vs, causal=causal, softmax_scale=scale, layout=layout, comm=comm,
                                       return_lse=True, **extra)
            dq, dk, dv = rd.ring_attention_backward(dos, qs, ks, vs, o, lse, causal=causal, softmax_scale=scale,
                                                    layout=layout, comm=comm, **extra)
            cp.cuda.get_current_stream().synchronize()
            check_ring(tag, {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, q, k, v, do, causal, scale, dtype,
                       part=part)
            if "--torch" in argv:   # the same case through autograd: the same kernels, the same bits
                _check_autograd(tag, (qs, ks, vs, dos), (o, dq, dk, dv), causal, scale, layout, comm, dtype)
        except Exception as exc:  # noqa: BLE001 - every case runs on every rank (the ring needs all of them)
            failures.append(f"{tag}: {type(exc).__name__}: {exc}")
            print(f"FAIL {failures[-1]}", flush=True)
    print(f"rank {rank}: {len(CASES) - len(failures)}/{len(CASES)} cases pass", flush=True)
    if "--torch" in argv:
        import torch.distributed as dist
        dist.destroy_process_group()
    return 1 if failures else 0


def _check_autograd(tag, inputs, expected, causal, scale, layout, comm, dtype):
    """rtkernels.torch.ring_attention's o and its gradients (loss.backward() with do) equal the
    CuPy-path results: o, dk and dv bit for bit; dq within a rounding of the direct call's (the
    backward's default dQ accumulation adds key tiles' float32 partials in arrival order, so two
    runs of the same call may round a dq element differently - seen once in 18 rank-cases)."""
    import cupy as cp
    import torch
    import rtkernels.torch as rtt

    def to_torch(x):
        t = torch.from_dlpack(x)
        return t.view(torch.bfloat16) if dtype == "bfloat16" else t

    q, k, v, do = (to_torch(x).clone() for x in inputs)
    for t in (q, k, v):
        t.requires_grad_(True)
    o, _ = rtt.ring_attention(q, k, v, causal=causal, softmax_scale=scale, layout=layout, comm=comm)
    o.backward(do)
    torch.cuda.synchronize()
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad), expected):
        cp.cuda.get_current_stream().synchronize()
        want = to_torch(want)
        if name == "dq":
            tol = 2.0 ** -7 * max(float(want.float().abs().max()), 1e-6)
            diff = float((got.detach().float() - want.float()).abs().max())
            assert diff <= tol, f"{tag}: autograd dq differs from the direct call by {diff:.3g} (> {tol:.3g})"
        else:
            assert torch.equal(got.detach(), want), f"{tag}: autograd {name} differs from the direct call"
    print(f"{tag}: autograd o, dq, dk, dv equal the direct call", flush=True)


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
