"""CPU tests of the core: render, configs, NVRTC compile, ptxas report, cache, errors."""
import json
import multiprocessing as mp
import os
import time
import uuid
import warnings

import pytest

import rtkernels as rtk
from rtkernels import cache
from rtkernels.compiler import CompileOptions, parse_ptxas_report
from rtkernels.kernel import build_module, kernel_names, parse_signature
from rtkernels.render import render

SCALE = """// user template for tests
#include "rtk/common.cuh"
using T = {{ dtype | ctype }};
constexpr int VEC = {{ vec }};
extern "C" __global__ void scale(T* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
{% if vec > 4 %}
    this_is_not_defined(i);
{% endif %}
    if (i < n) x[i] = rtk::from_float<T>(a * rtk::to_float(x[i]) + {{ bias }});
}
"""


def unique_template(tag=None):
    """A template no earlier test compiled (a fresh constant in the source)."""
    return rtk.Template(SCALE.replace("// user template", f"// user template {tag or uuid.uuid4().hex}"))


# ---- render ---------------------------------------------------------------------------
def test_render_ctype_and_line_directives():
    r = render(rtk.Template(SCALE, name="scale.cu.j2"), {"dtype": "bfloat16", "vec": 4, "bias": 1.5})
    assert "using T = __nv_bfloat16;" in r.source
    assert "#line" not in r.source and "@rtk" not in r.source
    assert '#line 1 "scale.cu.j2"' in r.compiled_source
    assert '#line 10 "scale.cu.j2"' in r.compiled_source   # after the skipped {% if %} block
    # every mapped line points back at the template line holding the same text
    tlines = SCALE.split("\n")
    for text, origin in zip(r.compiled_source.split("\n"), r.line_map):
        if origin and text.strip() and "{{" not in tlines[origin[1] - 1]:
            assert tlines[origin[1] - 1] == text


def test_render_strict_undefined_names_template_and_line():
    with pytest.raises(rtk.CompileError, match=r"line 10.*'bias' is undefined"):
        render(rtk.Template(SCALE, name="scale.cu.j2"), {"dtype": "float32", "vec": 4})


def test_render_syntax_error_names_line():
    with pytest.raises(rtk.CompileError, match=r"line 2"):
        render(rtk.Template("ok\n{% if %}\n", name="bad.cu.j2"), {})


def test_block_comments_and_continuations_survive_markers():
    text = "/* a\n b */\n#define X(a) \\\n  (a + 1)\nextern \"C\" __global__ void k(int* p) { p[0] = X(1); }\n"
    k = rtk.compile(rtk.Template(text), kernel="k")
    assert k.resources.registers > 0


# ---- configs ----------------------------------------------------------------------------
@pytest.mark.parametrize("params, match", [
    ({"dtype": "int3"}, r"vector_add: dtype='int3' is not allowed; dtype must be one of float16, bfloat16, float32"),
    ({"block_size": 100}, r"block_size=100 .* power of two in \[32, 1024\]"),
    ({"block_size": 2048}, r"block_size=2048"),
    ({"blocksize": 64}, r"unknown parameter\(s\) 'blocksize'; vector_add takes dtype, block_size"),
])
def test_config_errors(params, match):
    with pytest.raises(rtk.ConfigError, match=match):
        rtk.compile("vector_add", **params)


def test_unknown_family_lists_known():
    with pytest.raises(rtk.ConfigError, match=r"unknown kernel family 'nope'.*vector_add"):
        rtk.compile("nope")


def test_user_template_param_types():
    with pytest.raises(rtk.ConfigError, match=r"vec=\[1\] is not allowed; vec must be an int, float, bool or dtype"):
        rtk.compile(rtk.Template(SCALE), kernel="scale", dtype="float32", vec=[1], bias=0)
    with pytest.raises(rtk.ConfigError, match=r"mode='fast'"):
        rtk.compile(rtk.Template(SCALE), kernel="scale", dtype="float32", vec=1, bias=0, mode="fast")


def test_bad_arch():
    with pytest.raises(rtk.ConfigError, match=r"arch='gfx90a'"):
        rtk.compile("vector_add", arch="gfx90a")


# ---- compile ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_vector_add_compiles(arch, dtype):
    k = rtk.compile("vector_add", dtype=dtype, block_size=128, arch=arch)
    assert k.cubin[:4] == b"\x7fELF"
    assert k.arch == arch
    r = k.resources
    assert 4 <= r.registers <= 32 and r.spill_stores == 0 and r.stack_frame == 0
    assert ".text.vector_add" in k.sass and "EXIT" in k.sass
    assert "LDG.E" in k.sass and "STG.E" in k.sass


def test_ptx_on_request():
    k = rtk.compile("vector_add", dtype="float32", arch="sm_90")
    assert ".entry vector_add" in k.ptx and ".target sm_90" in k.ptx


def test_user_template_from_file_and_text(tmp_path):
    p = tmp_path / "scale.cu.j2"
    p.write_text(SCALE)
    k1 = rtk.compile(str(p), kernel="scale", dtype="bfloat16", vec=4, bias=0.5)
    k2 = rtk.compile(rtk.Template(SCALE), dtype="bfloat16", vec=4, bias=0.5)  # single kernel: name inferred
    assert k1.name == k2.name == "scale"
    assert [p.kind for p in k1.signature] == ["pointer", "scalar", "scalar"]


def test_name_expression_kernel():
    t = rtk.Template("template <int N> __global__ void fill(int* p) { p[threadIdx.x] = N; }\n"
                     "template __global__ void fill<3>(int*);\n")
    k = rtk.compile(t, kernel="fill<3>")
    assert k.lowered_name.startswith("_Z") and k.resources.registers > 0


def test_ptxas_report_parser():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'attn' for 'sm_90'
ptxas info    : Function properties for attn
    1024 bytes stack frame, 96 bytes spill stores, 128 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16384 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'other' for 'sm_90'
ptxas info    : Function properties for other
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 360 bytes cmem[0]
"""
    r = parse_ptxas_report(log)
    assert r["attn"] == rtk.Resources(registers=255, spill_stores=96, spill_loads=128, stack_frame=1024,
                                      shared_static=16384, constant=400, barriers=1)
    assert r["other"].registers == 12 and r["other"].shared_static == 0


def test_signature_parser():
    src = ('extern "C" __global__ void __launch_bounds__(256) f(const __half* __restrict__ a, float s, '
           'long long n, unsigned m, const __grid_constant__ CUtensorMap tm, __nv_bfloat16 b) {}')
    sig = parse_signature(src, "f")
    assert [(p.kind, p.ctype) for p in sig] == [("pointer", "__half*"), ("scalar", "float"),
                                                ("scalar", "long long"), ("scalar", "unsigned"),
                                                ("struct", "CUtensorMap"), ("scalar", "__nv_bfloat16")]
    assert kernel_names(src) == ["f"]
    aliased = "using acc_t = float;\ntypedef long long idx_t;\n" + src.replace("float s", "acc_t s").replace(
        "long long n", "idx_t n")
    assert [p.ctype for p in parse_signature(aliased, "f")][1:3] == ["float", "long long"]


# ---- errors -------------------------------------------------------------------------------
def test_compile_error_points_at_template_file_and_line(tmp_path):
    p = tmp_path / "scale_bad.cu.j2"
    p.write_text(SCALE)
    with pytest.raises(rtk.CompileError) as ei:
        rtk.compile(str(p), kernel="scale", dtype="float32", vec=8, bias=0)
    msg = str(ei.value)
    assert f"{p}:8: error: identifier \"this_is_not_defined\" is undefined" in msg   # template line 8
    assert "NVRTC 13." in msg or "NVRTC 12." in msg
    assert "sm_90" in msg and "--gpu-architecture=sm_90" in msg
    assert ">     7 |     this_is_not_defined(i);" in msg   # rendered line 7, marked
    assert "vec=8" in msg
    assert ei.value.source_path and os.path.exists(ei.value.source_path)
    assert "this_is_not_defined(i);" in open(ei.value.source_path).read()


# ---- cache --------------------------------------------------------------------------------
def test_cache_miss_then_memory_then_disk_hit(fresh_cache):
    t = unique_template()
    k1 = rtk.compile(t, dtype="float32", vec=1, bias=0)
    assert cache.stats()["misses"] == 1
    k2 = rtk.compile(t, dtype="float32", vec=1, bias=0)
    assert k2 is k1                                   # the compile() memo: no render, no lookup
    cache.clear_memory()
    k3 = rtk.compile(t, dtype="float32", vec=1, bias=0)
    assert cache.stats()["disk_hits"] == 1 and k3.cubin == k1.cubin
    assert k3.resources == k1.resources               # the ptxas report survives the disk round trip
    # ... and the compile's NVRTC seconds (Kernel.compile_seconds: what a cached kernel saved)
    assert 0 < k1.compile_seconds < 600 and k3.compile_seconds == round(k1.compile_seconds, 4)
    entries = cache.list_entries()
    assert len(entries) == 1
    d = entries[0]["path"]
    assert sorted(os.listdir(d)) == ["kernel.cubin", "meta.json", "source.cu"]
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["resources"]["scale"]["registers"] == k1.resources.registers
    assert meta["compile_s"] == k3.compile_seconds
    assert oct(os.stat(fresh_cache).st_mode & 0o777) == "0o700"


def _key_parts(**over):
    base = {"source": "x", "arch": "sm_90", "output": "cubin", "options": ["-std=c++17"], "name_expressions": [],
            "nvrtc": [13, 5], "headers": "h", "package": "0.1.0"}
    base.update(over)
    return base


@pytest.mark.parametrize("change", [
    {"source": "y"}, {"arch": "sm_90a"}, {"arch": "sm_80"}, {"output": "ptx"}, {"options": ["-std=c++20"]},
    {"name_expressions": ["f<1>"]}, {"nvrtc": [13, 0]}, {"headers": "h2"}, {"package": "0.2.0"},
])
def test_key_changes_with_each_part(change):
    assert cache.make_key(_key_parts()) != cache.make_key(_key_parts(**change))


def test_key_changes_with_schema(monkeypatch):
    k = cache.make_key(_key_parts())
    monkeypatch.setattr(cache, "SCHEMA", cache.SCHEMA + 1)
    assert cache.make_key(_key_parts()) != k


def test_key_changes_in_practice(fresh_cache):
    t = unique_template()
    mods = [build_module(t, {"dtype": "float32", "vec": 1, "bias": 0}, label="t", config_repr="", arch="sm_90",
                         options=CompileOptions()),
            build_module(t, {"dtype": "float32", "vec": 1, "bias": 1}, label="t", config_repr="", arch="sm_90",
                         options=CompileOptions()),
            build_module(t, {"dtype": "float32", "vec": 1, "bias": 0}, label="t", config_repr="", arch="sm_80",
                         options=CompileOptions()),
            build_module(t, {"dtype": "float32", "vec": 1, "bias": 0}, label="t", config_repr="", arch="sm_90",
                         options=CompileOptions(fast_math=True))]
    assert len({m.key for m in mods}) == 4


def test_corrupt_entry_is_discarded_and_rebuilt(fresh_cache):
    t = unique_template()
    k = rtk.compile(t, dtype="float32", vec=1, bias=0)
    path = cache.list_entries()[0]["path"]
    with open(os.path.join(path, "kernel.cubin"), "r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage\x00")
    cache.clear_memory()
    with pytest.warns(cache.CacheWarning, match="digest mismatch"):
        k2 = rtk.compile(t, dtype="float32", vec=1, bias=0)
    assert k2.cubin == k.cubin and cache.stats()["corrupt"] == 1
    cache.clear_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rtk.compile(t, dtype="float32", vec=1, bias=0).cubin == k.cubin   # the rebuilt entry is valid


def test_unwritable_cache_dir_falls_back_to_memory_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(cache, "_disk_off_reason", None)
    cache.clear_memory()
    with pytest.warns(cache.CacheWarning, match="disk cache disabled") as rec:
        rtk.compile(unique_template(), dtype="float32", vec=1, bias=0)
        rtk.compile(unique_template(), dtype="float32", vec=1, bias=0)
    assert len([w for w in rec if issubclass(w.category, cache.CacheWarning)]) == 1
    assert not cache.disk_enabled()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_cache_dir(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(ro))
    monkeypatch.setattr(cache, "_disk_off_reason", None)
    with pytest.warns(cache.CacheWarning):
        k = rtk.compile(unique_template(), dtype="float32", vec=1, bias=0)
    assert k.resources.registers > 0


def test_cache_disabled_by_env(fresh_cache, monkeypatch):
    monkeypatch.setenv("RTKERNELS_CACHE", "0")
    rtk.compile(unique_template(), dtype="float32", vec=1, bias=0)
    assert cache.list_entries() == []


def _compile_in_child(args):
    cache_dir, tag = args
    os.environ["RTKERNELS_CACHE_DIR"] = cache_dir
    import rtkernels as rtk_child
    k = rtk_child.compile(unique_template(tag), dtype="float16", vec=2, bias=1)
    return k.module.key, len(k.cubin)


def test_threads_asking_for_one_module_build_it_once(fresh_cache, monkeypatch):
    """Threads that ask for the same new module at once share one NVRTC compile: the others wait
    for the first and get its Module (build_module's in-flight keys); a failed build lets the
    next waiter build it itself, so each caller meets the error."""
    import threading
    import rtkernels.kernel as K
    calls = []
    real = K.compile_source
    started = threading.Event()

    def slow_compile(*a, **kw):
        calls.append(threading.get_ident())
        started.set()
        time.sleep(0.3)          # (the other threads arrive while this one compiles)
        return real(*a, **kw)
    monkeypatch.setattr(K, "compile_source", slow_compile)
    t = unique_template()
    params = {"dtype": "float32", "vec": 1, "bias": 0}
    out = [None] * 4
    def build(i):
        out[i] = build_module(t, params, label="scale", config_repr="", arch="sm_90",
                              options=CompileOptions())
    threads = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    threads[0].start()
    started.wait(60)
    for th in threads[1:]:
        th.start()
    for th in threads:
        th.join(60)
    assert len(calls) == 1 and cache.stats()["misses"] == 1
    assert all(m is out[0] for m in out) and out[0] is not None
    assert not K._building   # nothing left in flight

    def failing(*a, **kw):
        calls.append(threading.get_ident())
        time.sleep(0.1)
        raise rtk.CompileError("boom")
    monkeypatch.setattr(K, "compile_source", failing)
    calls.clear()
    errors = []
    bad = unique_template()
    def build_same():
        try:
            build_module(bad, params, label="scale", config_repr="", arch="sm_90", options=CompileOptions())
        except rtk.CompileError as e:
            errors.append(e)
    threads = [threading.Thread(target=build_same) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(errors) == 3 and len(calls) == 3 and not K._building


def test_get_kernels_compiles_a_module_per_kernel_at_once(fresh_cache):
    """The Hopper backward compiles each entry point as its own module (only its own code), all
    three at once on threads; a second call is the memo's."""
    from rtkernels.ops import attention_bwd_sm90 as B90
    cfg = B90.choose_config("bfloat16", 64, False, False)
    ks = rtk.get_kernels(cfg, arch="sm_90a")
    assert [k.name for k in ks] == list(cfg.kernels)
    assert len({id(k.module) for k in ks}) == 3
    for k in ks:
        assert kernel_names(k.module.source) == [k.name]
    assert cache.stats()["misses"] == 3
    assert all(a is b for a, b in zip(rtk.get_kernels(cfg, arch="sm_90a"), ks))
    assert rtk.get_kernel(cfg, cfg.kernels[1], arch="sm_90a") is ks[1]
    assert B90.kernels_for(cfg, "sm_90a") == ks


def test_four_processes_compile_the_same_config(fresh_cache):
    tag = uuid.uuid4().hex
    with mp.get_context("spawn").Pool(4) as pool:
        results = pool.map(_compile_in_child, [(str(fresh_cache), tag)] * 4)
    assert len({r[0] for r in results}) == 1
    entries = cache.list_entries()
    assert len(entries) == 1
    leftovers = [n for n in os.listdir(os.path.dirname(entries[0]["path"])) if n.startswith(".")]
    assert leftovers == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.disk_get(results[0][0]) is not None      # valid digest


def test_cache_info_and_clear(fresh_cache):
    rtk.compile(unique_template(), dtype="float32", vec=1, bias=0)
    info = cache.info()
    assert info["entries"] == 1 and info["bytes"] > 0 and info["root"] == str(fresh_cache)
    assert cache.clear() == 1 and cache.list_entries() == []


def test_launch_plans_key_rules_and_bound():
    """LaunchPlans (rtkernels.ops._arrays): only CuPy arrays / CUDA torch tensors get a key (host
    arrays and unhashable options take the op's full path); the table empties when full."""
    import numpy as np
    from rtkernels.ops._arrays import LaunchPlans
    plans = LaunchPlans(maxsize=2)
    assert plans.key((np.zeros(4),), ("op",)) is None
    assert plans.key((None, None), ("op",)) is None
    assert plans.get(None) is None
    plans.put(None, "ignored")
    assert len(plans) == 0
    plans.put(("a",), 1)
    plans.put(("b",), 2)
    assert plans.get(("a",)) == 1 and len(plans) == 2
    plans.put(("c",), 3)                   # full: emptied, then stored
    assert len(plans) == 1 and plans.get(("a",)) is None and plans.get(("c",)) == 3
    plans.clear()
    assert len(plans) == 0
