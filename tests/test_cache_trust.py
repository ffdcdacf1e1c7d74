"""The disk cache runs only code its owner could have written (issue 28).

CPU tests: roots and folders others can write (world, group, another owner, a parent without
the sticky bit) give one CacheWarning and memory-only caching, shared mode, owner-only
permissions under umask 000, the issue's planted-CUBIN reproduction, meta.json figures and
tuned configs that are not trusted, ``rtk cache info``, and the import layering.  GPU tests:
a meta.json whose figures contradict its CUBIN is discarded at load and the launch runs the
fresh module; true entries of every family load without a warning.
"""
import ast
import json
import os
import shutil
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest

import rtkernels as rtk
from rtkernels import autotune, cache, cli
from rtkernels.compiler import Resources
from rtkernels.kernel import resource_mismatch

ARCH = "sm_90"


def _compile(dtype="float32"):
    return rtk.compile("vector_add", dtype=dtype, block_size=256, arch=ARCH)


def _reset(monkeypatch):
    """Clean in-process cache state: nothing memoized, disk level on, no root verdicts."""
    monkeypatch.setattr(cache, "_disk_off_reason", None)
    monkeypatch.setattr(cache, "_verdicts", {})
    monkeypatch.setattr(cache, "_checked", set())
    monkeypatch.delenv("RTKERNELS_CACHE_SHARED", raising=False)
    monkeypatch.delenv("RTKERNELS_CACHE", raising=False)
    cache.clear_memory()
    cache.reset_stats()


def _cache_warnings(rec):
    return [w for w in rec if issubclass(w.category, cache.CacheWarning)]


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """A trusted root holding the float32 and float16 vector_add entries (compiled once for the module)."""
    root = tmp_path_factory.mktemp("seed") / "root"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RTKERNELS_CACHE_DIR", str(root))
        _reset(mp)
        k32, k16 = _compile("float32"), _compile("float16")
        out = {"root": root, "k32": k32.module.key, "k16": k16.module.key, "cubin32": k32.cubin,
               "cubin16": k16.cubin}
        cache.clear_memory()
    assert "HADD2" in k16.sass   # the planted body is recognizable by its half-precision adds
    return out


@pytest.fixture
def clean(monkeypatch):
    _reset(monkeypatch)
    yield monkeypatch
    cache.clear_memory()


def _copy_seed(seed, dest: Path) -> Path:
    shutil.copytree(seed["root"], dest, symlinks=True)
    return dest


def _entry(root: Path, key: str) -> Path:
    return root / f"v{cache.SCHEMA}" / key[:2] / key


def _expect_memory_only(monkeypatch, root: Path, folder: Path, match: str, seed):
    """Compile twice from an untrusted root: one warning naming ``folder``, no disk reads or writes."""
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(root))
    before = sorted(str(p) for p in root.rglob("*"))
    with pytest.warns(cache.CacheWarning) as rec:
        k = _compile("float32")
        cache.clear_memory()
        k2 = _compile("float32")
    ws = _cache_warnings(rec)
    assert len(ws) == 1, [str(w.message) for w in ws]
    msg = str(ws[0].message)
    assert str(folder) in msg and match in msg and "memory only" in msg, msg
    assert "mode " in msg and "owner uid" in msg, msg
    st = cache.stats()
    assert st["disk_hits"] == 0 and st["misses"] == 2, st   # compiled, never read from the root
    assert k.cubin == k2.cubin == seed["cubin32"] and k.resources.registers > 0
    assert not cache.disk_enabled()
    assert sorted(str(p) for p in root.rglob("*")) == before   # nothing written there either
    return msg


def _expect_trusted(monkeypatch, root: Path):
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        k = _compile("float32")
    assert cache.stats()["disk_hits"] == 1 and cache.disk_enabled()
    return k


# ---- the root's own mode -------------------------------------------------------------------
ROOT_MODES = [
    (0o700, False, True, None),
    (0o755, False, True, None),
    (0o777, False, False, "writable by every user"),
    (0o1777, False, False, "writable by every user"),          # the sticky bit does not stop new entries
    (0o770, False, False, "writable by its group"),
    (0o770, True, True, None),                                  # a team cache, chosen explicitly
    (0o2770, True, True, None),
    (0o777, True, False, "never world-writable"),               # shared mode never accepts world-writable
    (0o1777, True, False, "never world-writable"),
]


@pytest.mark.parametrize("mode, shared, trusted, match", ROOT_MODES,
                         ids=[f"{m:04o}-{'shared' if sh else 'private'}" for m, sh, _, _ in ROOT_MODES])
def test_root_mode(seed, clean, tmp_path, mode, shared, trusted, match):
    root = _copy_seed(seed, tmp_path / "root")
    os.chmod(root, mode)
    if shared:
        clean.setenv("RTKERNELS_CACHE_SHARED", "1")
    if trusted:
        _expect_trusted(clean, root)
    else:
        msg = _expect_memory_only(clean, root, root, match, seed)
        assert f"mode {mode:04o}" in msg
        if "group" in match:
            assert "RTKERNELS_CACHE_SHARED=1" in msg and f"chmod 700 {root}" in msg


def _fake_lstat(monkeypatch, target: Path, uid=None, gid=None):
    """Report ``target`` as owned by ``uid``/``gid`` (CI cannot chown)."""
    real = os.lstat

    def lstat(p):
        st = real(p)
        if os.fspath(p) == str(target):
            vals = list(st[:10])
            vals[4] = st.st_uid if uid is None else uid
            vals[5] = st.st_gid if gid is None else gid
            return os.stat_result(vals)
        return st
    monkeypatch.setattr(cache, "_lstat", lstat)


def _stranger_uid() -> int:
    return os.geteuid() + 4242   # neither us nor root


def _stranger_gid() -> int:
    gid = 4242
    while gid in cache._groups():
        gid += 1
    return gid


def test_root_owned_by_another_user(seed, clean, tmp_path):
    root = _copy_seed(seed, tmp_path / "root")
    os.chmod(root, 0o755)
    _fake_lstat(clean, root, uid=_stranger_uid())
    msg = _expect_memory_only(clean, root, root, "belongs to another user", seed)
    assert f"uid {_stranger_uid()}" in msg and "RTKERNELS_CACHE_DIR" in msg


def test_shared_root_of_a_teammate_is_trusted_only_through_a_group_we_share(seed, clean, tmp_path):
    root = _copy_seed(seed, tmp_path / "root")
    os.chmod(root, 0o2770)
    clean.setenv("RTKERNELS_CACHE_SHARED", "1")
    _fake_lstat(clean, root, uid=_stranger_uid())          # a teammate's folder, our group
    _expect_trusted(clean, root)
    assert "every member of its group" in cache.check_root().why


def test_shared_root_of_a_group_we_are_not_in(seed, clean, tmp_path):
    root = _copy_seed(seed, tmp_path / "root")
    os.chmod(root, 0o2770)
    clean.setenv("RTKERNELS_CACHE_SHARED", "1")
    _fake_lstat(clean, root, uid=_stranger_uid(), gid=_stranger_gid())
    _expect_memory_only(clean, root, root, "belongs to another user", seed)


# ---- folders above and below the root ----------------------------------------------------------
@pytest.mark.parametrize("sticky", [False, True])
def test_parent_world_writable(seed, clean, tmp_path, sticky):
    parent = tmp_path / "public"
    parent.mkdir()
    root = _copy_seed(seed, parent / "root")
    os.chmod(parent, 0o1777 if sticky else 0o777)
    if sticky:   # like /tmp: others cannot rename our root away
        _expect_trusted(clean, root)
    else:
        msg = _expect_memory_only(clean, root, parent, "without the sticky bit", seed)
        assert f"chmod o-w {parent}" in msg


@pytest.mark.parametrize("which, mode, match", [("v", 0o770, "writable by its group"),
                                                 ("xx", 0o777, "writable by every user")], ids=["v1-0770", "xx-0777"])
def test_subfolder_writable_by_others(seed, clean, tmp_path, which, mode, match):
    root = _copy_seed(seed, tmp_path / "root")
    entry = _entry(root, seed["k32"])
    folder = entry.parent.parent if which == "v" else entry.parent
    os.chmod(folder, mode)
    _expect_memory_only(clean, root, folder, match, seed)


def test_world_writable_entry_file_is_discarded_and_rebuilt(seed, clean, tmp_path):
    """An entry file others could write (an old entry written under umask 000) is never loaded."""
    root = _copy_seed(seed, tmp_path / "root")
    meta = _entry(root, seed["k32"]) / "meta.json"
    os.chmod(meta, 0o666)
    clean.setenv("RTKERNELS_CACHE_DIR", str(root))
    with pytest.warns(cache.CacheWarning, match="writable by every user") as rec:
        k = _compile("float32")
    assert len(_cache_warnings(rec)) == 1 and cache.stats()["misses"] == 1
    assert k.cubin == seed["cubin32"] and stat.S_IMODE(os.stat(meta).st_mode) == 0o600   # rewritten
    cache.clear_memory()
    assert _expect_trusted(clean, root).cubin == seed["cubin32"]


def test_checks_run_once_per_root(seed, clean, tmp_path):
    """After the first disk access, the root and the folders above it are not examined again."""
    root = _copy_seed(seed, tmp_path / "root")
    clean.setenv("RTKERNELS_CACHE_DIR", str(root))
    _compile("float32")
    seen = []
    real = os.lstat
    clean.setattr(cache, "_lstat", lambda p: seen.append(os.fspath(p)) or real(p))
    cache.clear_memory()
    _compile("float32")
    _compile("float16")
    assert cache.stats()["disk_hits"] == 3
    above = {str(root), str(root / f"v{cache.SCHEMA}"), *map(str, root.parents)}
    assert not above & set(seen), seen


# ---- permissions of what is written --------------------------------------------------------------
@pytest.fixture
def umask_000():
    old = os.umask(0)
    yield
    os.umask(old)


def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_entries_are_owner_only_under_umask_000(clean, tmp_path, umask_000):
    root = tmp_path / "a" / "b" / "root"     # missing folders above are created too
    clean.setenv("RTKERNELS_CACHE_DIR", str(root))
    k = _compile("float32")
    entry = _entry(root, k.module.key)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", root, entry.parent.parent, entry.parent, entry):
        assert _mode(folder) == 0o700, (folder, oct(_mode(folder)))
    for f in entry.iterdir():
        assert _mode(f) == 0o600, (f, oct(_mode(f)))
    assert autotune.store({"k": {"config": {"block_size": 256}}})
    assert _mode(autotune.path()) == 0o600 and _mode(root / "autotune-v1.lock") == 0o600
    assert cache.disk_enabled()


def test_shared_entries_are_group_readable_under_umask_000(clean, tmp_path, umask_000):
    root = tmp_path / "team"
    clean.setenv("RTKERNELS_CACHE_DIR", str(root))
    clean.setenv("RTKERNELS_CACHE_SHARED", "1")
    k = _compile("float32")
    entry = _entry(root, k.module.key)
    assert _mode(root) & 0o777 == 0o770
    for folder in (entry.parent.parent, entry.parent):
        assert _mode(folder) & 0o777 == 0o770 and _mode(folder) & 0o002 == 0
    assert _mode(entry) == 0o750
    for f in entry.iterdir():
        assert _mode(f) == 0o640, (f, oct(_mode(f)))
    assert autotune.store({"k": {"config": {"block_size": 256}}}) and _mode(autotune.path()) == 0o640


# ---- the issue's reproduction ------------------------------------------------------------------
def _plant(root: Path, seed, fix_digest: bool) -> Path:
    """Copy the float16 body over the float32 entry's code, with or without a matching digest."""
    import hashlib
    e32 = _entry(root, seed["k32"])
    (e32 / "kernel.cubin").write_bytes(seed["cubin16"])
    if fix_digest:
        meta = json.loads((e32 / "meta.json").read_text())
        meta["code_sha256"] = hashlib.sha256(seed["cubin16"]).hexdigest()
        (e32 / "meta.json").write_text(json.dumps(meta))
    return e32


def test_planted_cubin_in_untrusted_root_is_never_loaded(seed, clean, tmp_path):
    root = _copy_seed(seed, tmp_path / "shared-rtk")
    _plant(root, seed, fix_digest=True)
    os.chmod(root, 0o777)
    _expect_memory_only(clean, root, root, "writable by every user", seed)
    k = _compile("float32")
    assert k.cubin == seed["cubin32"] != seed["cubin16"]
    assert "HADD2" not in k.sass and "FADD" in k.sass        # compiled afresh from the float32 source


def test_trusted_root_digest_still_catches_corruption(seed, clean, tmp_path):
    root = _copy_seed(seed, tmp_path / "root")
    e32 = _plant(root, seed, fix_digest=False)
    clean.setenv("RTKERNELS_CACHE_DIR", str(root))
    with pytest.warns(cache.CacheWarning, match="digest mismatch"):
        k = _compile("float32")
    assert k.cubin == seed["cubin32"] and (e32 / "kernel.cubin").read_bytes() == seed["cubin32"]  # rebuilt


# ---- figures from meta.json --------------------------------------------------------------------
def test_resource_mismatch():
    true = {"f": Resources(registers=32, shared_static=4096)}
    assert resource_mismatch(true, {"f": {"registers": 32, "shared_static": 4096}}) is None
    assert "registers=24" in resource_mismatch({"f": Resources(registers=24, shared_static=4096)},
                                               {"f": {"registers": 32, "shared_static": 4096}})
    assert "shared_static=0" in resource_mismatch({"f": Resources(registers=32)},
                                                  {"f": {"registers": 32, "shared_static": 4096}})
    assert "no resources for the function g" in resource_mismatch(true, {"g": {"registers": 8}})


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["resources"]["vector_add"].update(registers="many"), "malformed meta.json"),
    (lambda m: m["resources"]["vector_add"].update(not_a_figure=1), "malformed meta.json"),
    (lambda m: m.update(lowered={"vector_add<float>": "vector_add"}), "lowered names"),
], ids=["registers-not-a-number", "unknown-figure", "lowered-names"])
def test_malformed_meta_is_discarded(seed, clean, tmp_path, edit, match):
    root = _copy_seed(seed, tmp_path / "root")
    path = _entry(root, seed["k32"]) / "meta.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    clean.setenv("RTKERNELS_CACHE_DIR", str(root))
    with pytest.warns(cache.CacheWarning, match=match):
        k = _compile("float32")
    assert k.cubin == seed["cubin32"] and k.resources.registers > 0 and cache.stats()["misses"] == 1


def test_load_check_discards_and_rebinds(seed, clean, tmp_path):
    """The load-time comparison, with the driver replaced by fakes: a meta.json that understates
    the registers is discarded at the first load, the module compiled afresh, and the kernel's
    launcher rebuilt from the true figures; a true entry loads once without a word."""
    import contextlib
    import cupy
    from rtkernels import kernel as kmod
    root = _copy_seed(seed, tmp_path / "root")
    path = _entry(root, seed["k32"]) / "meta.json"
    meta = json.loads(path.read_text())
    truth = meta["resources"]["vector_add"]["registers"]
    meta["resources"]["vector_add"]["registers"] = truth - 4
    path.write_text(json.dumps(meta))
    clean.setenv("RTKERNELS_CACHE_DIR", str(root))
    k = _compile("float32")
    assert k.resources.registers == truth - 4 and k.module.from_disk
    launcher, loads = k.launch, []

    class FakeModule:
        def get_function(self, name):
            return type("Fn", (), {"ptr": 1, "name": name})()
    clean.setattr(kmod.Module, "_load_code", lambda self, dev: loads.append(self.code) or FakeModule())
    clean.setattr(cupy.cuda, "Device", lambda dev: contextlib.nullcontext())
    clean.setattr(kmod, "_entry_functions", lambda mod: ["vector_add"])
    clean.setattr(kmod, "_reported_resources",
                  lambda mod, names: {n: {"registers": truth, "shared_static": 0} for n in names})
    with pytest.warns(cache.CacheWarning, match=f"registers={truth - 4}, the loaded code {truth}"):
        assert k.function(0).name == "vector_add"
    assert k.module.generation == 1 and k.resources.registers == truth and k.launch is not launcher
    assert len(loads) == 2 and loads[1] == seed["cubin32"]
    assert json.loads(path.read_text())["resources"]["vector_add"]["registers"] == truth   # rewritten
    cache.clear_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        k2 = _compile("float32")
        k2.function(0)
    assert k2.module.generation == 0 and not k2.module.from_disk and len(loads) == 3


def test_module_from_disk_is_marked_for_the_load_check(seed, clean, tmp_path):
    root = _copy_seed(seed, tmp_path / "root")
    k = _expect_trusted(clean, root)
    assert k.module.from_disk and k.module.generation == 0
    cache.clear_memory()
    clean.setenv("RTKERNELS_CACHE_DIR", str(tmp_path / "other"))
    assert not _compile("float32").module.from_disk          # compiled here: nothing to check


# ---- the tuning file ---------------------------------------------------------------------------
def _tune_setup(monkeypatch, root: Path, stored_config: dict):
    from rtkernels.ops.vector_add import VectorAddConfig
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(root))
    monkeypatch.setenv("RTKERNELS_AUTOTUNE", "1")
    autotune.clear_memory()
    cands = [VectorAddConfig(dtype="float32", block_size=b) for b in (128, 256)]
    name = autotune.make_key("vector_add", {"n": 1})
    assert autotune.store({name: {"config": stored_config, "ms": 0.001, "family": "vector_add"}})
    return cands


def test_invalid_tuned_config_is_dropped(clean, tmp_path):
    cands = _tune_setup(clean, tmp_path / "root", {"dtype": "float32", "block_size": 100})
    timed = []
    with pytest.warns(autotune.AutotuneWarning, match=r"dropping the tuned vector_add config.*block_size"):
        best = autotune.pick("vector_add", {"n": 1}, cands, None, cands[0], arch=ARCH,
                             measure=lambda r, c: timed.append(c) or (1.0 if c is cands[0] else 0.5))
    assert best is cands[1] and timed            # tuned again, the invalid config never used
    autotune.clear_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.pick("vector_add", {"n": 1}, cands, None, cands[0], measure=lambda r, c: 1 / 0) is cands[1]
    autotune.clear_memory()


def test_tuning_file_in_untrusted_root_is_not_read(clean, tmp_path):
    root = tmp_path / "root"
    cands = _tune_setup(clean, root, {"dtype": "float32", "block_size": 256})
    os.chmod(root, 0o777)
    clean.setattr(cache, "_verdicts", {})
    with pytest.warns(cache.CacheWarning, match="writable by every user"):
        assert autotune.load() == {}
    timed = []
    assert autotune.pick("vector_add", {"n": 1}, cands, None, cands[0], arch=ARCH,
                         measure=lambda r, c: timed.append(c) or 1.0) is cands[0]
    assert timed                                  # the planted winner was not taken
    autotune.clear_memory()


# ---- rtk cache info ----------------------------------------------------------------------------
def test_cache_info_shows_trust(clean, tmp_path, capsys):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    clean.setenv("RTKERNELS_CACHE_DIR", str(root))
    assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"root             {root}" in out and "mode             0700" in out and "trusted          yes:" in out
    assert "owner            uid" in out
    os.chmod(root, 0o777)
    assert cli.main(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["trusted"] is False and info["mode"] == "0777" and "writable by every user" in info["why"]
    assert info["disk_enabled"] is False
    assert cli.main(["cache", "info"]) == 0
    assert "trusted          NO:" in capsys.readouterr().out


# ---- import layering ---------------------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    """rtkernels modules a file imports, at any depth (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rtkernels."):
            out.add(node.module.split(".")[1])
    return out


def test_no_import_back_edges():
    """Data flows render -> compiler -> cache -> kernel: no module imports one further down."""
    pkg = Path(rtk.__file__).parent
    order = ["render", "compiler", "cache", "kernel"]
    for i, name in enumerate(order):
        later = set(order[i + 1:]) & _imports(pkg / f"{name}.py")
        assert not later, f"{name}.py imports {sorted(later)}"


# ---- GPU: figures contradicted by the loaded code -------------------------------------------------
SMEM_TEMPLATE = r"""
// static and dynamic shared memory together beyond the 48 KiB default
constexpr int TILE = {{ tile }};
constexpr int STATIC_FLOATS = {{ static_floats }};
extern "C" __global__ void __launch_bounds__(TILE)
smem_mirror(const float* __restrict__ x, float* __restrict__ y, int n)
{
    __shared__ float buf[STATIC_FLOATS];
    extern __shared__ float dyn[];
    const int t = threadIdx.x;
    const long long i = (long long)blockIdx.x * TILE + t;
    const float v = i < n ? x[i] : 0.f;
    buf[(t * 7) % STATIC_FLOATS] = v;
    dyn[t] = v;
    __syncthreads();
    if (i < n) y[i] = buf[(t * 7) % STATIC_FLOATS] + 2.f * dyn[TILE - 1 - t];
}
"""
STATIC_FLOATS, TILE, DYN_BYTES = 8192, 256, 20 * 1024   # 32 KiB static + 20 KiB dynamic > 48 KiB


def _smem_template():
    return rtk.Template(SMEM_TEMPLATE, name="smem_mirror.cu.j2")


def _smem_reference(x: np.ndarray) -> np.ndarray:
    n = x.size
    pad = np.zeros(-(-n // TILE) * TILE, dtype=np.float64)
    pad[:n] = x
    t = pad.reshape(-1, TILE)
    return (t + 2.0 * t[:, ::-1]).reshape(-1)[:n]


def _run_smem(k, n=1000 + 17):
    import cupy as cp
    from gpu_util import poison
    x = cp.random.standard_normal(n, dtype=cp.float32)
    y = poison(cp.empty(n, dtype=cp.float32))
    k.launch((-(-n // TILE),), (TILE,), x, y, n, shared_mem=DYN_BYTES)
    err = float(np.max(np.abs(cp.asnumpy(y) - _smem_reference(cp.asnumpy(x)))))
    assert err <= 1e-5, f"max error {err} (n={n}, tile={TILE}, static={STATIC_FLOATS * 4} B, dynamic={DYN_BYTES} B)"


@pytest.mark.gpu
@pytest.mark.parametrize("field, lie", [("shared_static", lambda v: 0), ("shared_static", lambda v: v - 1024),
                                        ("registers", lambda v: max(1, v - 8)), ("registers", lambda v: v + 8)],
                         ids=["static-smem-0", "static-smem-minus-1KiB", "registers-minus-8", "registers-plus-8"])
def test_meta_contradicted_by_loaded_code_is_discarded(fresh_cache, field, lie):
    t = _smem_template()
    params = {"tile": TILE, "static_floats": STATIC_FLOATS}
    k0 = rtk.compile(t, **params)
    truth = k0.resources
    assert truth.shared_static >= STATIC_FLOATS * 4, truth
    path = Path(cache.list_entries()[0]["path"]) / "meta.json"
    meta = json.loads(path.read_text())
    told = lie(getattr(truth, field))
    meta["resources"]["smem_mirror"][field] = told
    path.write_text(json.dumps(meta))
    cache.clear_memory()
    k = rtk.compile(t, **params)
    assert k.module.from_disk and getattr(k.resources, field) == told        # read, not yet loaded
    with pytest.warns(cache.CacheWarning, match=f"meta.json says smem_mirror has {field}={told}"):
        _run_smem(k)                     # the load discards the entry; this launch runs the fresh module
    assert k.resources == truth and k.module.generation == 1, (k.resources, truth)
    assert json.loads(path.read_text())["resources"]["smem_mirror"][field] == getattr(truth, field)
    _run_smem(k)
    cache.clear_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        k2 = rtk.compile(t, **params)
        _run_smem(k2)                    # the rewritten entry is true: loads without a word
    assert cache.stats()["disk_hits"] >= 2


@pytest.mark.gpu
def test_true_entries_of_every_family_load_without_warning(fresh_cache):
    """No false alarm: for each family's default config, the ptxas figures stored in meta.json
    equal what the driver reports for the loaded CUBIN (registers, static shared memory)."""
    from rtkernels import device
    from rtkernels.config import family_config
    arch = device.current_arch()
    configs = []
    for fam in rtk.families():
        try:
            configs.append(family_config(fam).from_params({}, arch))
        except rtk.ConfigError:
            continue   # a family for another arch (e.g. the Hopper ones on an sm_80 part)
    for c in configs:
        rtk.get_kernel(c)
    cache.clear_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        for c in configs:
            for name in c.kernels:
                k = rtk.get_kernel(c, name)
                k.function()
                print(f"{c.family:20s} {name:28s} registers={k.resources.registers:3d} "
                      f"static smem={k.resources.shared_static}")
                assert k.module.generation == 0
    assert cache.stats()["disk_hits"] == len(configs)
