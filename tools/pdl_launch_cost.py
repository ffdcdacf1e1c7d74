"""Host cost of one launch of a 4-argument kernel: CuPy's Function.linear_launch against rtkernels'
PdlFunction (programmatic dependent launch through cuLaunchKernelEx), its parameter packing alone,
and the driver calls with the parameters prepared beforehand (ctypes and cuda.bindings, with and
without the PDL attribute).  Median and min of 7 rounds of 300 launches, microseconds.

    PYTHONPATH=. python3 tools/pdl_launch_cost.py          # on the GPU host (sm_90)

Figures: docs/data/pdl_launch_cost_session25_2026-11-27.log (H100 and H200 hosts, 2026-11-27)."""
import statistics
import sys
import time
from array import array

sys.path.insert(0, ".")

SRC = r'''extern "C" __global__ void axpy3(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) c[i] = a[i] + b[i]; }'''


def main() -> None:
    import cupy as cp
    from cuda.bindings import driver as drv
    from cupy.cuda.function import CIntptr
    from rtkernels import pdl
    fn = cp.RawModule(code=SRC).get_function("axpy3").kernel
    a, b, c = (cp.zeros(256, cp.float32) for _ in range(3))
    s = cp.cuda.Stream(non_blocking=True)
    pdl._lookups()
    pf = pdl.PdlFunction(fn)
    import ctypes
    launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx   # (the driver CuPy loaded)
    launch.restype = ctypes.c_int
    launch.argtypes = (ctypes.c_void_p,) * 4

    def config(nattr):
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 1, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 256, 1, 1
        cfg.sharedMemBytes = 0
        cfg.hStream = drv.CUstream(s.ptr)
        cfg.attrs = list(pdl._ATTR[:nattr])
        cfg.numAttrs = nattr
        return cfg

    def params():   # what PdlFunction builds per launch: holders, then their addresses
        held = [x if type(x) in pdl._HOLDERS else pdl._holder(x) for x in args]
        return array("q", [h.ptr for h in held]), held

    cfg0, cfg1 = config(0), config(1)
    args = (a, b, c, CIntptr(256))
    ptrs, held = params()   # (held: the holders the prebuilt addresses point into stay alive)
    pa = ptrs.buffer_info()[0]
    cuf = drv.CUfunction(fn.ptr)
    cands = {
        "cupy linear_launch": lambda: fn.linear_launch(256, args, 0, 256, s),
        "PdlFunction.linear_launch": lambda: pf.linear_launch(256, args, 0, 256, s),
        "params only": params,
        "ctypes Ex, 0 attrs, prebuilt params": lambda: launch(cfg0.getPtr(), fn.ptr, pa, None),
        "ctypes Ex, PDL attr, prebuilt params": lambda: launch(cfg1.getPtr(), fn.ptr, pa, None),
        "bindings cuLaunchKernel prebuilt": lambda: drv.cuLaunchKernel(cuf, 1, 1, 1, 256, 1, 1, 0, s.ptr, pa, 0),
        "bindings Ex PDL prebuilt": lambda: drv.cuLaunchKernelEx(cfg1, cuf, pa, 0),
    }
    for k in ("bindings cuLaunchKernel prebuilt", "bindings Ex PDL prebuilt"):   # (they launch: no error code)
        assert cands[k]()[0] == drv.CUresult.CUDA_SUCCESS, k
    for k in ("ctypes Ex, 0 attrs, prebuilt params", "ctypes Ex, PDL attr, prebuilt params"):
        assert cands[k]() == 0, k
    res = {k: [] for k in cands}
    for _ in range(7):   # rounds interleaved: every candidate meets the same host state
        for k, f in cands.items():
            s.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                f()
            res[k].append((time.perf_counter() - t0) / 300 * 1e6)
            s.synchronize()
    for k, v in res.items():
        print(f"{k:<40} {statistics.median(v):6.2f} {min(v):6.2f}")


if __name__ == "__main__":
    main()
