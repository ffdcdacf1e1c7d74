"""How much of the no-spill config sweeps the CPU tests compile."""
import os

# The no-spill sweeps over every config the heuristics can choose compile hundreds of kernels
# (~15 min of CI on 2 cores by themselves, 2026-11-25).  CI compiles a sample that keeps every
# tile class and edge (the smallest, the largest and each heuristics-table boundary head dim);
# RTKERNELS_TEST_FULL_SWEEP=1 compiles everything (run it where cores are plenty, e.g. the GPU host).
FULL_SWEEP = os.environ.get("RTKERNELS_TEST_FULL_SWEEP") == "1"
