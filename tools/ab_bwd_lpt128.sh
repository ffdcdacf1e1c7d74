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
timeout 90 $PY tools/prebuild_bwd_ab.py --tests test_attention_bwd_sm90_lpt --head-dims "$HEAD_DIMS" "${ALTS[@]}" \
    >"$W/prebuild.txt" 2>&1
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
