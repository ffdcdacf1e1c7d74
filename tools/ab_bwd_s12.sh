#!/usr/bin/env bash
# A/B of attention_bwd_sm90_big's stagger (non-causal: each CTA's query-tile walk starts at its
# diagonal tile; session 12, before ring + stagger became the non-causal default, docs/RESULTS.md) and three Q stages beside one dO stage (d256 "kt"), GPU tests first.  Everything
# lands in ONE tarball, $OUT/ab_bwd_s12.tar.gz (default OUT ./ab_out):
#   prebuild.txt        the bench's configs compiled in parallel first (disk cache)
#   tests_stagger.txt   pytest -m gpu tests/test_attention_bwd_sm90_big_stagger.py
#   d256/  tools/bench_attention_bwd.py --grid fa --head-dims 256 (S 2k / 4k / 16k) with four --alt columns:
#          stagger=true | dq_mode=ring,stagger=true | dq_mode=red,num_stages=3,do_stages=1 | the same + stagger
#   d192/  the same grid at d192 with --alt stagger=true
# The last thing printed is one short table per head dim: TFLOP/s, rtk / best peer (faster of FA4 and
# SDPA cuDNN), each alt over the default (same run) and over the best peer; "-" where an alt does not
# apply (stagger is non-causal only).  FA4 is optional: put it on PYTHONPATH first.  About 4 minutes.
set -u
OUT=${OUT:-./ab_out}
W=$(mktemp -d)
mkdir -p "$OUT" "$W/d256" "$W/d192"
export PYTHONPATH=".:tools${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python}
ALTS256=(--alt stagger=true --alt dq_mode=ring,stagger=true --alt dq_mode=red,num_stages=3,do_stages=1
         --alt dq_mode=red,num_stages=3,do_stages=1,stagger=true)
ALTS192=(--alt stagger=true)

# the bench's configs (default, deterministic, each alt) and the tests' compiled in parallel into the disk cache
{ timeout 60 $PY tools/prebuild_bwd_ab.py --tests test_attention_bwd_sm90_big_stagger --head-dims 256 "${ALTS256[@]}"
  timeout 30 $PY tools/prebuild_bwd_ab.py --head-dims 192 "${ALTS192[@]}"; } >"$W/prebuild.txt" 2>&1
echo "prebuild rc $?: $(tail -1 "$W/prebuild.txt")"
timeout 100 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_attention_bwd_sm90_big_stagger.py \
    >"$W/tests_stagger.txt" 2>&1
echo "stagger / s3do1 tests (rc $?): $(tail -1 "$W/tests_stagger.txt")"
timeout 120 $PY tools/bench_attention_bwd.py --grid fa --head-dims 256 --seqlens 2048,4096,16384 "${ALTS256[@]}" \
    --out "$W/d256" >"$W/d256/log.txt" 2>&1
echo "d256 bench rc $?"
timeout 60 $PY tools/bench_attention_bwd.py --grid fa --head-dims 192 --seqlens 2048,4096,16384 "${ALTS192[@]}" \
    --out "$W/d192" >"$W/d192/log.txt" 2>&1
echo "d192 bench rc $?"
tar -czf "$OUT/ab_bwd_s12.tar.gz" -C "$W" .
for sub in d256 d192; do   # the bench's compact table: each alt's TFLOP/s, over the default, over the best peer
    echo; echo "== $sub"; sed -n '/^backward TFLOP\/s; ratio_vs_best/,$p' "$W/$sub/log.txt"
done
rm -rf "$W"
