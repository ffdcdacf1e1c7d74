"""The gap between two kernels queued back to back: with or without an event recorded between them,
and with programmatic dependent launch (PDL).  spin: 132 CTAs busy for 20 us (triggering its
dependents at the start, or not); dep: launched after it (with the programmatic stream
serialization attribute, or plainly) stamps its entry and its griddepcontrol.wait return with
%globaltimer.  Prints each against spin's last block's end.

    PYTHONPATH=. python3 tools/launch_gap_probe.py      # on the GPU host (sm_90)

H200, 2026-11-27, two runs (docs/data/launch_gap_probe_session24_2026-11-27_h200.log): back to
back, the next kernel entered 1.6-1.8 us after the last block of the one before; with an event
recorded between them 2.9-3.3 us (PDL or not: it does not overlap across the event); with PDL and no
event its blocks entered up to 3.8 us before the first kernel's end (when it triggers) and its wait
returned 0.64-0.80 us after it.
Why it matters: tools/benchutil.time_queued's events="each" charged every call that extra ~1.5 us."""
import ctypes
import cupy as cp
import numpy as np
from cuda.bindings import driver as drv

src = r'''
extern "C" __global__ void spin(unsigned long long* t, long long ns, int trigger) {
  unsigned long long t0; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (trigger) asm volatile("griddepcontrol.launch_dependents;");
  unsigned long long t1 = t0;
  while (t1 - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) { t[2*blockIdx.x] = t0; t[2*blockIdx.x+1] = t1; }
}
extern "C" __global__ void dep(unsigned long long* t) {
  unsigned long long t0; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  asm volatile("griddepcontrol.wait;" ::: "memory");
  unsigned long long t1; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) { t[2*blockIdx.x] = t0; t[2*blockIdx.x+1] = t1; }
}
'''
mod = cp.RawModule(code=src, options=("-arch=sm_90",))
spin, dep = mod.get_function("spin"), mod.get_function("dep")
ts = cp.zeros(264, cp.uint64)
td = cp.zeros(264, cp.uint64)
stream = cp.cuda.Stream(non_blocking=True)

def launch_ex(fn, grid, block, args, pdl):
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
    cfg.sharedMemBytes = 0
    cfg.hStream = drv.CUstream(stream.ptr)
    attrs = []
    if pdl:
        a = drv.CUlaunchAttribute()
        a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = 1
        attrs.append(a)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    holders = args
    ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    err, = drv.cuLaunchKernelEx(cfg, drv.CUfunction(fn.kernel.ptr), ctypes.addressof(ptrs), 0)
    assert err == drv.CUresult.CUDA_SUCCESS, err

for event_between in (False, True):
    for trigger in (1, 0):
        for pdl in (True, False):
            with stream:
                for _ in range(3):
                    launch_ex(spin, 132, 128, [ctypes.c_uint64(ts.data.ptr), ctypes.c_int64(20000), ctypes.c_int32(trigger)], False)
                    if event_between:
                        cp.cuda.Event().record(stream)
                    launch_ex(dep, 132, 128, [ctypes.c_uint64(td.data.ptr)], pdl)
            stream.synchronize()
            s = ts.get().astype(np.int64).reshape(-1, 2)[:132]
            d = td.get().astype(np.int64).reshape(-1, 2)[:132]
            spin_end = s[:, 1].max()
            print(f"event_between={event_between} trigger={trigger} pdl={pdl}: dep entry - spin end "
                  f"{(d[:, 0].min() - spin_end) / 1e3:+.2f} .. {(d[:, 0].max() - spin_end) / 1e3:+.2f} us; "
                  f"wait returns {(d[:, 1].min() - spin_end) / 1e3:+.2f} .. {(d[:, 1].max() - spin_end) / 1e3:+.2f} us")
