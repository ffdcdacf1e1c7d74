"""Kernel families, one module each (config, heuristics, wrapper).  Importing registers them.

The public functions are re-exported by ``rtkernels`` itself, not here: a package attribute
named like its submodule (``rtkernels.ops.matmul``) must stay the module, so that
``import rtkernels.ops.matmul as m`` gives the module and not the function.
"""
from . import (  # noqa: F401  (one module per line: parallel work merges cleanly)
    adamw,
    attention,
    attention_bwd,
    attention_bwd_sm90,
    attention_bwd_sm90_big,
    attention_kvcache,
    attention_merge,
    attention_sm90,
    cross_entropy,
    elementwise,
    matmul,
    matmul_fp8,
    matmul_sm90,
    quant_matmul,
    rowwise,
    rowwise_bwd,
    vector_add,
)

PUBLIC = {
    "vector_add": ("vector_add", "VectorAddConfig"),
    "elementwise": ("elementwise", "ElementwiseConfig", "ElementwiseFunction"),
    "matmul": ("matmul", "MatmulConfig", "matmul_reference", "PadRowsConfig"),
    "attention": ("attention", "AttentionConfig", "attention_reference"),
    "attention_sm90": ("AttentionSm90Config",),
    "matmul_sm90": ("MatmulSm90Config",),
    "matmul_fp8": ("MatmulFp8Config", "Fp8TransposeConfig", "matmul_fp8_reference"),
    "attention_bwd": ("attention_backward", "AttentionBwdConfig", "attention_backward_reference"),
    "attention_bwd_sm90": ("AttentionBwdSm90Config",),
    "attention_bwd_sm90_big": ("AttentionBwdSm90BigConfig",),
    "attention_merge": ("attention_merge", "AttentionMergeConfig", "attention_merge_reference"),
    "attention_kvcache": ("attention_kvcache", "check_kvcache_inputs", "AttentionDecodeConfig",
                          "attention_kvcache_reference"),
    "rowwise": ("softmax", "rmsnorm", "layernorm", "reduce", "SoftmaxConfig", "NormConfig", "ReduceConfig"),
    "rowwise_bwd": ("rmsnorm_backward", "layernorm_backward", "softmax_backward", "NormBwdConfig", "SoftmaxBwdConfig"),
    "cross_entropy": ("cross_entropy", "CrossEntropyConfig"),
    "adamw": ("adamw_step", "AdamWConfig"),
    "quant_matmul": ("quantized_matmul", "quantize_weight", "dequantize_weight", "quantized_matmul_reference",
                     "QuantGemvConfig"),
}
