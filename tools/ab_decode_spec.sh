#!/usr/bin/env bash
# Speculative decoding (seqlen_q 4-16, issue #15): the rows mode's warpgroup MMAs (mma=wgmma) and the
# lazy O rescale against the defaults, contiguous and paged16, one run.  Under $OUT (default ./ab_out):
#   tests_wgmma.txt    tests/test_attention_kvcache_wgmma.py (CPU + GPU: wgmma, lazy rescale)
#   tests_smoke.txt    the default paths' reference tests (the softmax code both share)
#   bench/             tools/bench_decode.py --variants (JSON, log)
#   ab_decode_spec.tgz all of the above in one file
# and the last thing printed is the variants table (% of copy).  About 3 minutes of GPU time.
set -u
OUT=${OUT:-./ab_out}
mkdir -p "$OUT/bench"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >"$OUT/gpu.txt" 2>&1
timeout 150 $PY -m pytest -q -p no:cacheprovider -rf tests/test_attention_kvcache_wgmma.py >"$OUT/tests_wgmma.txt" 2>&1
echo "wgmma + lazy rescale tests (rc $?): $(tail -1 "$OUT/tests_wgmma.txt")"
timeout 90 $PY -m pytest -q -p no:cacheprovider -rf tests/test_attention_kvcache.py -m gpu \
    -k "test_gpu_against_float64_reference or rows_mode_many_rows or fused_merge_paths" >"$OUT/tests_smoke.txt" 2>&1
echo "default-path smoke tests (rc $?): $(tail -1 "$OUT/tests_smoke.txt")"
timeout 240 $PY tools/bench_decode.py --quick --no-host --no-sdpa --layouts contig,paged16 \
    --variant-layouts contig,paged16 \
    --shapes 8:8192:32:8:128:4,8:8192:32:8:128:8,8:8192:32:8:128:16,1:32768:32:8:128:4,1:32768:32:8:128:8,1:32768:32:8:128:16 \
    --variants "wg=mma:wgmma;wg64=mma:wgmma+block_n:64+num_stages:3;wgs6=mma:wgmma+num_stages:6;lz=lazy_rescale:1;wglz=mma:wgmma+lazy_rescale:1" \
    --out "$OUT/bench" >"$OUT/bench/log.txt" 2>&1
echo "bench rc $?"
tar czf "$OUT/ab_decode_spec.tgz" -C "$OUT" gpu.txt tests_wgmma.txt tests_smoke.txt bench 2>/dev/null
grep -E "^(FAILED|ERROR)" "$OUT/tests_wgmma.txt" "$OUT/tests_smoke.txt" | head -20
sed -n '/^variants x forced splits/,/^$/p' "$OUT/bench/log.txt"
grep -m1 "device copy" "$OUT/bench/log.txt"
