#!/usr/bin/env bash
# A/B (session 12; lpt_grid is now the causal default from d120) of the d <= 128 Hopper backward's
# grid / walk options (attention_bwd_sm90: lpt_grid - causal key
# tiles heaviest first in L2-sized sections of (batch, kv head) pairs; stagger - each CTA's non-causal
# walk starts at its diagonal query tile), GPU tests first.  Everything lands in ONE tarball,
# $OUT/ab_bwd_lpt128.tar.gz (default OUT ./ab_out):
#   prebuild.txt     the tests' and the bench's configs compiled in parallel first (disk cache)
#   tests_lpt.txt    pytest -m gpu tests/test_attention_bwd_sm90_lpt.py
#   bench/           tools/bench_attention_bwd.py --grid fa --head-dims 64,96,128 (S 2k / 4k / 16k) with
#                    --alt lpt_grid=true --alt stagger=true (JSON, PNG, log)
# The last thing printed is one short table per head dim: TFLOP/s, rtk / best peer (faster of FA4 and
# SDPA cuDNN), each alt over the default (same run, interleaved rounds) and over the best peer; "-" where
# an alt does not apply (lpt_grid is causal only, stagger non-causal only).  FA4 is optional: put it on
# PYTHONPATH first.  About 4 minutes.
set -u
OUT=${OUT:-./ab_out}
W=$(mktemp -d)
mkdir -p "$OUT" "$W/bench"
export PYTHONPATH=".:tools${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python}
ALTS=(--alt lpt_grid=true --alt stagger=true)
HEAD_DIMS=64,96,128

# the bench's configs (default, deterministic, each alt) and the tests' compiled in parallel into the disk cache
timeout 90 $PY - "$HEAD_DIMS" "${ALTS[@]}" >"$W/prebuild.txt" 2>&1 <<'PYEOF'
import dataclasses, sys, time
sys.path.insert(0, "tests")
from bench_attention_bwd import _alt_config
from rtkernels import inspect as rinspect
from rtkernels.ops import attention_bwd_sm90 as B90
import test_attention_bwd_sm90_lpt as T
t0 = time.perf_counter()
specs = sys.argv[3::2]
cfgs = T.gpu_configs()
for d in map(int, sys.argv[1].split(",")):
    for causal in (False, True):
        base = B90.choose_config("bfloat16", d, causal, False)
        cfgs |= {base, B90.choose_config("bfloat16", d, causal, True)}
        cfgs |= {c for c in (_alt_config(base, s) for s in specs) if c is not None}
reps = rinspect.sweep(B90.FAMILY, [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)} for c in cfgs],
                      arch="sm_90a", jobs=16)
for r in reps:
    print(r.get("status"), r.get("resources", r.get("error")), r.get("config"))
print(f"prebuilt {len(cfgs)} configs in {time.perf_counter() - t0:.1f} s")
PYEOF
echo "prebuild rc $?: $(tail -1 "$W/prebuild.txt")"
timeout 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_attention_bwd_sm90_lpt.py >"$W/tests_lpt.txt" 2>&1
echo "lpt / stagger GPU tests (rc $?): $(tail -1 "$W/tests_lpt.txt")"
timeout 170 $PY tools/bench_attention_bwd.py --grid fa --head-dims "$HEAD_DIMS" "${ALTS[@]}" --out "$W/bench" \
    >"$W/bench/log.txt" 2>&1
echo "bench rc $?"
tar -czf "$OUT/ab_bwd_lpt128.tar.gz" -C "$W" .
# the bench's compact table: each alt's TFLOP/s, over the default, over the best peer
sed -n '/^backward TFLOP\/s; ratio_vs_best/,$p' "$W/bench/log.txt"
rm -rf "$W"
