"""elementwise: expression parsing and code generation (CPU); numerics on the GPU (gpu marker)."""
import re

import pytest

import rtkernels as rtk
from rtkernels.ops.elementwise import ElementwiseConfig, parse_statements


def test_parse_inputs_outputs_temporaries():
    st, ins, outs = parse_statements("t = a*x + b; y = gelu(t) * 1e-3f + 2.5")
    assert ins == ("a", "x", "b") and outs == ("y",)
    assert st == ("acc_t t = a*x + b;", "y = gelu(t) * 1e-3f + 2.5;")


def test_parse_multiple_outputs():
    st, ins, outs = parse_statements("s = sin(x)\nc = cos(x)", outputs=("s", "c"))
    assert ins == ("x",) and outs == ("s", "c")


@pytest.mark.parametrize("expr, match", [
    ("", "empty expression"), ("y + 1", "not of the form"), ("x = x + 1", "cannot assign to 'x'"),
    ("y = n * 2", "'n' cannot be used"),
])
def test_parse_errors(expr, match):
    with pytest.raises(rtk.ConfigError, match=match):
        parse_statements(expr)


def test_config_validation():
    with pytest.raises(rtk.ConfigError, match="vec=8 is not allowed; vec must be at most 4"):
        ElementwiseConfig(inputs=(("x", "float32"),), outputs=(("y", "float32"),), vec=8)
    with pytest.raises(rtk.ConfigError, match="outputs"):
        ElementwiseConfig(outputs=(("y", "int32"),))


@pytest.mark.parametrize("dtype, vec, width", [("float16", 8, "128"), ("bfloat16", 8, "128"), ("float32", 4, "128"),
                                               ("float16", 1, "U16")])
def test_vectorized_sass(dtype, vec, width):
    st, ins, outs = parse_statements("y = sin(x)*sin(x) + cos(x)*cos(x)")
    cfg = ElementwiseConfig(statements=st, inputs=((ins[0], dtype),), outputs=((outs[0], dtype),), vec=vec)
    k = rtk.get_kernel(cfg, arch="sm_90")
    assert k.resources.spill_stores == 0 and k.resources.stack_frame == 0
    loads = re.findall(r"LDG\.E\.(\w+)", k.sass)
    assert width in loads


def test_scalar_inputs_become_kernel_params():
    st, ins, outs = parse_statements("y = a * x + b")
    cfg = ElementwiseConfig(statements=st, inputs=(("a", "scalar"), ("x", "float32"), ("b", "scalar")),
                            outputs=(("y", "float32"),))
    k = rtk.get_kernel(cfg, arch="sm_80")
    assert [(p.kind, p.ctype) for p in k.signature] == [("scalar", "float"), ("pointer", "T_x*"),
                                                       ("scalar", "float"), ("pointer", "T_y*"),
                                                       ("scalar", "long long")]
