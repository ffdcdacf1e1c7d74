#!/usr/bin/env bash
# A/B of attention_bwd_sm90_big's layout-"kt" options at head dim 256 (and lpt_grid at d192), with
# their GPU tests first.  Everything lands in ONE tarball, $OUT/ab_bwd_d256.tar.gz (default OUT
# ./ab_out), holding:
#   prebuild.txt                    the bench's configs compiled in parallel first (disk cache)
#   tests_options.txt               pytest -m gpu tests/test_attention_bwd_sm90_big_options.py
#   d256/  tools/bench_attention_bwd.py --grid fa --head-dims 256 with five --alt columns:
#          dq_mode=ring | lpt_grid=true | dq_mode=ring,lpt_grid=true | do_stages=1 | do_stages=2
#   d192/  S 2k / 4k of that grid at d192 (the default "qk" split ring) with --alt lpt_grid=true
#          (at 16k lpt_group picks one pair per section: the 3-D grid's own order)
# and the last thing printed is one short table (TFLOP/s, each alt's ratio to the faster of FA4 and
# SDPA cuDNN; non-causal cells leave lpt_grid empty: it is a causal option).  FA4 is optional: put
# it on PYTHONPATH first.  About 3 minutes of GPU time.
set -u
OUT=${OUT:-./ab_out}
W=$(mktemp -d)
mkdir -p "$OUT" "$W/d256" "$W/d192"
export PYTHONPATH=".:tools${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python}
ALTS256=(--alt dq_mode=ring --alt lpt_grid=true --alt dq_mode=ring,lpt_grid=true --alt do_stages=1 --alt do_stages=2)
ALTS192=(--alt lpt_grid=true)

# the bench's configs (default, deterministic, each alt) compiled in parallel into the disk cache
timeout 60 $PY - "${ALTS256[@]}" >"$W/prebuild.txt" 2>&1 <<'EOF'
import dataclasses, sys, time
from bench_attention_bwd import _alt_config
from rtkernels import inspect as rinspect
from rtkernels.ops import attention_bwd_sm90_big as BIG
t0 = time.perf_counter()
specs = sys.argv[2::2]
cfgs = set()
for d in (192, 256):
    for causal in (False, True):
        base = BIG.choose_config("bfloat16", d, causal, False)
        cfgs |= {base, BIG.choose_config("bfloat16", d, causal, True)}
        alts = specs if d == 256 else ["lpt_grid=true"]
        cfgs |= {c for c in (_alt_config(base, s) for s in alts) if c is not None}
reps = rinspect.sweep(BIG.FAMILY, [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)} for c in cfgs],
                      arch="sm_90a", jobs=16)
for r in reps:
    print(r.get("status"), r.get("resources", r.get("error")), r.get("config"))
print(f"prebuilt {len(cfgs)} configs in {time.perf_counter() - t0:.1f} s")
EOF
echo "prebuild rc $?: $(tail -1 "$W/prebuild.txt")"
timeout 100 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_attention_bwd_sm90_big_options.py \
    >"$W/tests_options.txt" 2>&1
echo "kt option tests (rc $?): $(tail -1 "$W/tests_options.txt")"
timeout 130 $PY tools/bench_attention_bwd.py --grid fa --head-dims 256 "${ALTS256[@]}" --out "$W/d256" \
    >"$W/d256/log.txt" 2>&1
echo "d256 bench rc $?"
timeout 50 $PY tools/bench_attention_bwd.py --grid fa --head-dims 192 --seqlens 2048,4096 "${ALTS192[@]}" --out "$W/d192" \
    >"$W/d192/log.txt" 2>&1
echo "d192 bench rc $?"
tar -czf "$OUT/ab_bwd_d256.tar.gz" -C "$W" .
for sub in d256 d192; do   # the bench's compact table: each alt's TFLOP/s, over the default, over the best peer
    echo; echo "== $sub"; sed -n '/^backward TFLOP\/s; ratio_vs_best/,$p' "$W/$sub/log.txt"
done
rm -rf "$W"
