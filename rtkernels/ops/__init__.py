"""Kernel families, one module each (config, heuristics, wrapper).  Importing registers them.

The public functions are re-exported by ``rtkernels`` itself, not here: a package attribute
named like its submodule (``rtkernels.ops.matmul``) must stay the module, so that
``import rtkernels.ops.matmul as m`` gives the module and not the function.
"""
from . import attention, attention_bwd, attention_bwd_sm90, attention_sm90, elementwise, matmul, matmul_sm90, rowwise, vector_add  # noqa: F401
from . import adamw, cross_entropy, rowwise_bwd  # noqa: F401  (training-step kernels)

PUBLIC = {
    "vector_add": ("vector_add", "VectorAddConfig"),
    "elementwise": ("elementwise", "ElementwiseConfig", "ElementwiseFunction"),
    "matmul": ("matmul", "MatmulConfig", "matmul_reference", "PadRowsConfig"),
    "attention": ("attention", "AttentionConfig", "attention_reference"),
    "attention_sm90": ("AttentionSm90Config",),
    "matmul_sm90": ("MatmulSm90Config",),
    "attention_bwd": ("attention_backward", "AttentionBwdConfig", "attention_backward_reference"),
    "attention_bwd_sm90": ("AttentionBwdSm90Config",),
    "rowwise": ("softmax", "rmsnorm", "layernorm", "reduce", "SoftmaxConfig", "NormConfig", "ReduceConfig"),
    "rowwise_bwd": ("rmsnorm_backward", "layernorm_backward", "softmax_backward", "NormBwdConfig", "SoftmaxBwdConfig"),
    "cross_entropy": ("cross_entropy", "CrossEntropyConfig"),
    "adamw": ("adamw_step", "AdamWConfig"),
}
