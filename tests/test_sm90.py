"""Hopper primitives (templates/include/rtk/sm90.cuh, rtkernels/tma.py): compile and SASS checks
on the CPU; one-tile TMA -> mbarrier -> wgmma round trips on an sm_90 GPU."""
import importlib.util
import pathlib

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.kernel import parse_signature
from rtkernels.render import Template

ROOT = pathlib.Path(__file__).resolve().parent.parent
TILE = Template.from_file(ROOT / "tests" / "templates" / "sm90_tile.cu.j2")


def _tile(dtype="bfloat16", n=128, trans_b=0, a_regs=0, arch="sm_90"):
    return rtk.compile(TILE, kernel="tile_mma", arch=arch, dtype=dtype, n=n, trans_b=trans_b, a_regs=a_regs)


def test_wgmma_header_matches_generator():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "tools" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.HEADER.read_text() == gen.generate(), "run: python tools/gen_wgmma.py"


@pytest.mark.parametrize("n,trans_b,a_regs", [(64, 0, 0), (128, 1, 0), (64, 0, 1), (256, 1, 1), (24, 0, 1)])
def test_tile_compiles_to_hopper_instructions(n, trans_b, a_regs):
    if trans_b and n % 64:
        pytest.skip("N-major B is loaded in 64-column boxes")
    k = _tile(n=n, trans_b=trans_b, a_regs=a_regs)
    assert k.module.arch == "sm_90a", "a template including rtk/sm90.cuh must be built for sm_90a"
    sass = k.sass
    assert "HGMMA" in sass and "UTMALDG" in sass and "SYNCS" in sass
    assert "LDL" not in sass and "STL" not in sass
    assert k.resources.spill_stores == 0 and k.resources.stack_frame == 0


def test_tensor_map_parameter_is_a_struct():
    sig = parse_signature(TILE.text, "tile_mma")
    assert [p.kind for p in sig[:2]] == ["struct", "struct"]
    assert sig[0].ctype == "TensorMap"


@pytest.mark.parametrize("kw,field", [
    (dict(ptr=8), "address"),
    (dict(strides=(100, 1)), "strides[0]"),        # 200 bytes: not a multiple of 16
    (dict(strides=(64, 2)), "strides[1]"),
    (dict(box=(64, 128)), "box[1]"),               # 256 bytes > 128-byte swizzle span
    (dict(box=(300, 64)), "box[0]"),
    (dict(box=(64, 4)), "box[1]"),                 # 8 bytes: TMA moves 16-byte multiples
    (dict(dtype="complex64"), "dtype"),
    (dict(swizzle=48), "swizzle"),
    (dict(shape=(1, 2, 3, 4, 5, 6), strides=(1,) * 6, box=(1,) * 6), "shape"),
])
def test_tensor_map_rejects_what_the_driver_would(kw, field):
    from rtkernels.tma import check_tensor_map
    args = dict(ptr=1 << 20, dtype="bfloat16", shape=(256, 512), strides=(512, 1), box=(64, 64), swizzle=128)
    args.update(kw)
    with pytest.raises(ConfigError) as e:
        check_tensor_map(**args)
    assert e.value.field == field and field in str(e.value)


# ---- GPU ---------------------------------------------------------------------------------------

def _hopper():
    from rtkernels import device
    if device.current_arch() not in ("sm_90", "sm_90a"):
        pytest.skip("needs an sm_90 GPU")


def _run_tile(dtype, n, trans_b, a_regs, m_valid, k_valid, lbo=8192, sbo=1024, seed=0):
    import cupy as cp
    from gpu_util import random_array, poison
    from rtkernels.tma import tensor_map
    rng = np.random.default_rng(seed)
    a, a64 = random_array(rng, (m_valid, k_valid), dtype)
    if trans_b:
        b, b64 = random_array(rng, (k_valid, n), dtype)                # (K, N), N contiguous
        tb = tensor_map(b, dtype, b.shape, (n, 1), (64, 64))
        ref = np.zeros((64, n))
        ref[:m_valid] = a64 @ b64
    else:
        b, b64 = random_array(rng, (n, k_valid), dtype)                # (N, K), K contiguous
        tb = tensor_map(b, dtype, b.shape, (k_valid, 1), (n, 64))
        ref = np.zeros((64, n))
        ref[:m_valid] = a64 @ b64.T
    ta = tensor_map(a, dtype, a.shape, (k_valid, 1), (64, 64))
    d = poison(cp.empty((64, n), cp.float32))
    k = _tile(dtype, n, trans_b, a_regs)
    k.launch((1,), (128,), ta, tb, a, m_valid, k_valid, d, lbo, sbo, shared_mem=1024 + 8192 + n * 128)
    return d.get().astype(np.float64), ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n,trans_b,a_regs,m_valid,k_valid", [
    (128, 0, 0, 64, 64),     # full tile, both operands through TMA + SW128
    (64, 0, 0, 50, 40),      # TMA zero fill past M and K (K = 40: 80-byte rows, a 16-byte multiple)
    (256, 0, 0, 64, 64),
    (8, 0, 0, 64, 64),
    (64, 1, 0, 64, 64),      # N-major B, one 64-wide block
    (128, 1, 0, 64, 64),     # N-major B, two blocks: exercises the leading-dimension offset
    (256, 1, 0, 33, 56),
    (64, 0, 1, 64, 64),      # A from registers (wgmma RS)
    (128, 1, 1, 61, 64),
])
def test_tile_round_trip(dtype, n, trans_b, a_regs, m_valid, k_valid):
    _hopper()
    got, ref = _run_tile(dtype, n, trans_b, a_regs, m_valid, k_valid)
    # f32 accumulation of 64 exactly-representable products: only summation order differs.
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_wrong_struct_size_is_a_type_error():
    _hopper()
    import cupy as cp
    k = _tile()
    small = np.zeros((), np.dtype([("x", "<u8", (8,))]))[()]
    with pytest.raises(TypeError, match="128 bytes"):
        k.launch((1,), (128,), small, small, cp.zeros(1, cp.uint16), 1, 1, cp.zeros(1, cp.float32), 16, 1024,
                 shared_mem=20000)


@pytest.mark.gpu
def test_tensor_map_memo_and_encode():
    _hopper()
    import cupy as cp
    from rtkernels.tma import tensor_map, tensor_map_for
    x = cp.zeros((128, 256), cp.float16)
    m1 = tensor_map_for(x, (64, 64))
    m2 = tensor_map(x, "float16", (128, 256), (256, 1), (64, 64))
    assert m1 is m2 and m1.nbytes == 128 and any(int(v) for v in m1["opaque"])
