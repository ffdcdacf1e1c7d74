"""Compile a Hopper-backward A/B's configs in parallel into the disk cache before it runs: a GPU test
module's (its ``gpu_configs()``) and, per head dim and causal, the op's config, its deterministic
twin and the config with each ``--alt`` applied (tools/bench_attention_bwd.py's syntax and rules).

    python tools/prebuild_bwd_ab.py --tests test_attention_bwd_sm90_lpt --head-dims 64,96,128 \\
        --alt lpt_grid=true --alt stagger=true

Prints one line per config (status, resources or error) and a count last.  The A/B scripts
(tools/ab_bwd_*.sh) call it first so that their GPU tests and bench load kernels instead of
compiling them one by one.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), d) for d in ("..", "../tests", ".")]

from bench_attention_bwd import _alt_config  # noqa: E402
from rtkernels import inspect as rinspect  # noqa: E402
from rtkernels.ops import attention_bwd_sm90 as B90  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", default=None, help="a tests/ module whose gpu_configs() to include")
    p.add_argument("--head-dims", default="", help="comma-separated head dims of the bench's cells")
    p.add_argument("--alt", action="append", default=[], help="NAME=VALUE[,NAME=VALUE], as the bench's --alt")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    t0 = time.perf_counter()
    cfgs = set(importlib.import_module(args.tests).gpu_configs()) if args.tests else set()
    for d in (int(x) for x in args.head_dims.split(",") if x):
        for causal in (False, True):
            base = B90.choose_config(args.dtype, d, causal, False)   # the big kernel's above d128
            cfgs |= {base, B90.choose_config(args.dtype, d, causal, True)}
            cfgs |= {c for c in (_alt_config(base, s) for s in args.alt) if c is not None}
    for family in sorted({c.family for c in cfgs}):
        mine = [c for c in cfgs if c.family == family]
        for r in rinspect.sweep(family, [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)} for c in mine],
                                arch="sm_90a", jobs=16):
            print(r.get("status"), r.get("resources", r.get("error")), r.get("config"))
    print(f"prebuilt {len(cfgs)} configs in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
