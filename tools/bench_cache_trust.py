"""What the cache's trust checks (issue 28) cost: once per process, per disk read, per module load,
and (nothing) per launch.  Run on a GPU host (the CPU rows run anywhere):

    PYTHONPATH=. python tools/bench_cache_trust.py --out results/

Rows, each the median of interleaved rounds:
- ``root check``: check_root() - the parents, the root, its mode and owner (once per process and root);
- ``disk read, checked``: disk_get of a present entry once the root's verdict is memoized (entry folder
  lstat, three files opened without following links and fstat'ed), against ``disk read, plain``: the
  same files read and hashed the way disk_get did before the checks;
- ``module load, checked`` / ``unchecked``: Module.load of a module read from disk, with the comparison
  of meta.json's registers and static shared memory against cuFuncGetAttribute, and without it;
- ``launch``: Kernel.launch against CuPy's RawKernel (the per-call path the checks must not touch).
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import benchutil as bu  # noqa: E402

NOOP = 'extern "C" __global__ void noop(float* p, int n) { if (threadIdx.x == 0 && n < 0) p[0] = 1.f; }'


def _us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _plain_read(d) -> None:
    """disk_get's reads before the trust checks (the baseline)."""
    meta = json.loads((d / "meta.json").read_text())
    code = (d / meta["code_file"]).read_bytes()
    (d / "source.cu").read_text()
    assert hashlib.sha256(code).hexdigest() == meta["code_sha256"]


def cpu_rows(rounds: int) -> list[dict]:
    import rtkernels as rtk
    from rtkernels import cache
    k = rtk.compile("vector_add", dtype="float32", arch=os.environ.get("RTKERNELS_ARCH", "sm_90"))
    key = k.module.key
    d = cache.trusted_root() / f"v{cache.SCHEMA}" / key[:2] / key
    cache.disk_get(key)   # memoize the root's verdict and its folders
    res = {"root check (once per process)": [], "disk read, checked": [], "disk read, plain": []}
    for _ in range(rounds):
        res["root check (once per process)"].append(_us(cache.check_root, 200))
        res["disk read, checked"].append(_us(lambda: cache.disk_get(key), 200))
        res["disk read, plain"].append(_us(lambda: _plain_read(d), 200))
    return [{"what": w, "us": statistics.median(v), "min_us": min(v)} for w, v in res.items()]


def gpu_rows(rounds: int, calls: int) -> list[dict]:
    import cupy as cp
    import rtkernels as rtk
    from rtkernels import cache, device
    configs = [("vector_add", {})]
    if device.current_arch().startswith("sm_90"):
        configs.append(("attention_bwd_sm90", {}))   # three entry functions, setmaxnreg
    rows = []
    for fam, params in configs:
        rtk.compile(fam, **params)
        res = {"checked": [], "unchecked": []}
        for _ in range(rounds):
            for variant in ("checked", "unchecked"):   # interleaved
                cache.clear_memory()
                k = rtk.compile(fam, **params)
                assert k.module.from_disk
                if variant == "unchecked":
                    k.module.from_disk = False
                t0 = time.perf_counter()
                k.module.load(device.current_device())
                res[variant].append((time.perf_counter() - t0) * 1e6)
        for variant, v in res.items():
            rows.append({"what": f"module load, {variant} ({fam})", "us": statistics.median(v), "min_us": min(v)})
    p = cp.zeros(1, cp.float32)
    raw = cp.RawKernel(NOOP, "noop")
    k = rtk.compile(rtk.Template(NOOP))
    n32 = cp.int32(1)
    res = {"launch: cupy.RawKernel": [], "launch: rtk Kernel.launch": []}
    for _ in range(rounds):
        res["launch: cupy.RawKernel"].append(bu.time_host(lambda: raw((1,), (32,), (p, n32)), calls))
        res["launch: rtk Kernel.launch"].append(bu.time_host(lambda: k.launch((1,), (32,), p, 1), calls))
    rows += [{"what": w, "us": statistics.median(v), "min_us": min(v)} for w, v in res.items()]
    return rows


def main():
    ap = bu.parser(__doc__)
    args = ap.parse_args()
    os.environ.setdefault("RTKERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="rtk-bench-trust-"))
    from rtkernels import device
    rounds = 5 if args.quick else 11
    rows = cpu_rows(rounds)
    env = {}
    if device.has_gpu():
        env = bu.environment()
        rows += gpu_rows(rounds, 2000 if args.quick else 10000)
    bu.save(args.out, "bench_cache_trust", {"env": env, "rows": rows})
    if env:
        print(f"{env['gpu']} ({env['arch']}), driver {env['driver']}, NVRTC {env['nvrtc']}, {env['date']}")
    print(bu.table(rows, ["what", "us", "min_us"]))


if __name__ == "__main__":
    main()
