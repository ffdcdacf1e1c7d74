"""What the matmul families share below the ops (bf16/fp16 ``matmul``, ``matmul_fp8``,
``quantized_matmul``): the tuning key's shape buckets and the epilogue's float64 activation
reference.  A leaf module, so that the fp8 and quantized ops need not import the matmul op."""
from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError


def tune_bucket(x: int) -> int:
    """Shape bucket of the tuning key: powers of two up to 512, then multiples of 256.

    Fine enough that 1792 and 1793 (different wave counts) tune separately.
    """
    if x <= 512:
        return 1 << max(0, (x - 1).bit_length())
    return -(-x // 256) * 256


def activation_reference(x: np.ndarray, activation: str | None) -> np.ndarray:
    """The fused epilogue's activation in float64 (references and tests)."""
    if activation in (None, "none"):
        return x
    if activation == "relu":
        return np.maximum(x, 0.0)
    if activation == "gelu":
        try:
            from scipy.special import erf
        except ImportError:
            erf = np.vectorize(math.erf, otypes=[np.float64])
        return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))
    if activation == "silu":
        return x / (1.0 + np.exp(-x))
    raise ConfigError.bad_value("matmul", "activation", activation, "None, 'relu', 'gelu' or 'silu'")
