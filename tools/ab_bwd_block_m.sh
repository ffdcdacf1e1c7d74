#!/usr/bin/env bash
# A/B of the Hopper backward's query rows per step (block_m 64, the default, vs 128) at head dim 64,
# with the GPU tests of block_m 128 first.  Everything lands under $OUT (default ./ab_out):
#   tests_block_m.txt, tests_regress.txt   pytest logs (block_m 128; the default kernel's own tests)
#   dense/  tools/bench_attention_bwd.py --quick --head-dims 64 --alt block_m=128 (+ deterministic)
#   varlen/ tools/bench_attention_masks.py --varlen --backward --head-dims 64 --bwd-alt block_m=128
# and the last thing printed is one short table (TFLOP/s; FA4 columns empty where it is absent).
# FA4 is optional: put it on PYTHONPATH before running.  About 3-4 minutes of GPU time.
set -u
OUT=${OUT:-./ab_out}
mkdir -p "$OUT/dense" "$OUT/varlen"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python}
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_attention_bwd_sm90_block_m.py >"$OUT/tests_block_m.txt" 2>&1
echo "block_m 128 tests (rc $?): $(tail -1 "$OUT/tests_block_m.txt")"
timeout 50 $PY -m pytest -q -x -p no:cacheprovider tests/test_attention_bwd_sm90.py -m gpu \
    -k "combined or deterministic_is or strided or launch_plans" >"$OUT/tests_regress.txt" 2>&1
echo "block_m 64 regression tests (rc $?): $(tail -1 "$OUT/tests_regress.txt")"
timeout 75 $PY tools/bench_attention_bwd.py --quick --head-dims 64 --alt block_m=128 \
    --alt block_m=128,deterministic=true --out "$OUT/dense" >"$OUT/dense/log.txt" 2>&1
echo "dense bench rc $?"
timeout 80 $PY tools/bench_attention_masks.py --varlen --backward --head-dims 64 --bwd-alt block_m=128 \
    --out "$OUT/varlen" >"$OUT/varlen/log.txt" 2>&1
echo "varlen bench rc $?"
OUT="$OUT" $PY - <<'EOF'
import json, os
out = os.environ["OUT"]


def rows(path):
    try:
        return json.load(open(os.path.join(out, path)))["rows"]
    except (OSError, ValueError, KeyError):
        return []


def fmt(x):
    return "-" if x is None else f"{x:.0f}" if x > 5 else f"{x:.3f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def line(name, a, b, det_a=None, det_b=None, fa4=None):
    vals = (a, b, ratio(b, a), det_a, det_b, fa4, ratio(a, fa4), ratio(b, fa4))
    print(f"| {name} | " + " | ".join(fmt(v) for v in vals) + " |")


print("\nbackward TFLOP/s, head_dim 64, bf16: block_m 64 (default) vs 128; det = deterministic")
print("| case | rtk64 | rtk128 | 128/64 | det64 | det128 | fa4 | 64/fa4 | 128/fa4 |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows("dense/bench_attention_bwd.json"):
    line(f"dense {'causal' if r['causal'] else 'full'} {r['seqlen']}", r["rtk_tflops"], r.get("rtk_alt_tflops"),
         r.get("rtk_det_tflops"), r.get("rtk_alt2_tflops"), r.get("fa4_tflops"))
for r in rows("varlen/bench_attention_varlen_bwd.json"):
    line(f"varlen causal {r['tokens']} tok (mean {r.get('mean_len')})", r["rtk_tflops"], r.get("rtk_alt_tflops"),
         fa4=r.get("fa4_tflops"))
    line(f"  dense twin {r.get('dense_shape')}", r.get("rtk_dense_tflops"), r.get("rtk_dense_alt_tflops"))
EOF
