"""level1 compiled-extension checks against fake packages with broken ``.so`` files.

The suite's ``test_compiled_extensions_load`` needs a GPU (hw_gpu), so here its helpers
(:func:`discover_extensions`, :func:`import_extensions`) and its assertion are driven
directly with fake extensions built by gcc in a temp dir. The missing ``_C`` case runs
through the suite in test_vllm_install_checks.py.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata as md
import importlib.util
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tvc.config.profile import REPO_ROOT
from tvc.env import vllm_install

# this interpreter's own suffix, e.g. .cpython-311-x86_64-linux-gnu.so
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]

GOOD_EXT = """\
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "%s", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_%s(void) { return PyModule_Create(&def); }
"""
UNDEFINED_SYMBOL_EXT = """\
extern int tvc_symbol_nobody_defines(void);
int tvc_calls_missing(void) { return tvc_symbol_nobody_defines(); }
"""
NEEDS_LIB_EXT = """\
extern int tvc_dep_value(void);
int tvc_calls_dep(void) { return tvc_dep_value(); }
"""


def _gcc(*args: str) -> None:
    proc = subprocess.run(["gcc", *args], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def fake_pkg(tmp_path_factory) -> Path:
    """``tvcfakeext`` with one good, one undefined-symbol, one missing-library and
    one not-ELF extension; returns the directory to put on PYTHONPATH."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the fake extensions "
                    "(apt-get install gcc)")
    inc = sysconfig.get_paths()["include"]
    if not (Path(inc) / "Python.h").is_file():
        pytest.skip(f"Python.h is not in {inc}: cannot build the good fake extension "
                    "(install this Python's development headers)")
    root = tmp_path_factory.mktemp("ext")
    pkg = root / "tvcfakeext"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    src = root / "src"
    src.mkdir()
    (src / "good.c").write_text(GOOD_EXT % ("_good_C", "_good_C"))
    _gcc("-shared", "-fPIC", f"-I{inc}", str(src / "good.c"), "-o",
         str(pkg / f"_good_C{SUFFIX}"))
    (src / "undef.c").write_text(UNDEFINED_SYMBOL_EXT)
    _gcc("-shared", "-fPIC", str(src / "undef.c"), "-o", str(pkg / f"_C{SUFFIX}"))
    (src / "dep.c").write_text("int tvc_dep_value(void) { return 1; }\n")
    _gcc("-shared", "-fPIC", str(src / "dep.c"), "-o", str(src / "libtvcdep.so"))
    (src / "needs.c").write_text(NEEDS_LIB_EXT)
    _gcc("-shared", "-fPIC", str(src / "needs.c"), f"-L{src}", "-ltvcdep", "-o",
         str(pkg / f"_moe_C{SUFFIX}"))
    (src / "libtvcdep.so").unlink()  # the library the extension links is gone
    (pkg / "_flash_C.abi3.so").write_text("this is not an ELF file\n")
    return root


def test_discover_extensions_keeps_only_this_interpreters_suffixes(
        tmp_path: Path) -> None:
    pkg = tmp_path / "vllm"
    (pkg / "vllm_flash_attn").mkdir(parents=True)
    for name in ("__init__.py", f"_C{SUFFIX}", "_moe_C.abi3.so",
                 "_C.cpython-312-x86_64-linux-gnu.so",  # another Python's build
                 "_C.cpython-39-x86_64-linux-gnu.so", "readme.txt", "_C.pyi",
                 "vllm_flash_attn/_vllm_fa2_C.abi3.so"):
        (pkg / name).write_text("")
    assert vllm_install.discover_extensions(pkg) == [
        "vllm._C", "vllm._moe_C", "vllm.vllm_flash_attn._vllm_fa2_C"]


def test_discover_extensions_on_the_installed_vllm() -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        pytest.skip("vLLM is not installed in this Python")
    names = vllm_install.discover_extensions(Path(spec.origin).parent)
    assert all(n.startswith("vllm.") and n.count(".") >= 1 for n in names)
    assert all("cpython" not in n and "abi3" not in n for n in names), names


@pytest.fixture(scope="module")
def import_results(fake_pkg: Path) -> dict[str, str]:
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(fake_pkg))
    try:
        names = vllm_install.discover_extensions(fake_pkg / "tvcfakeext")
        return vllm_install.import_extensions(names, timeout_s=120)
    finally:
        mp.undo()


def test_import_extensions_reports_each_failure(import_results) -> None:
    assert set(import_results) == {"tvcfakeext._C", "tvcfakeext._flash_C",
                                   "tvcfakeext._good_C", "tvcfakeext._moe_C"}
    assert import_results["tvcfakeext._good_C"] == ""  # positive control
    assert "undefined symbol: tvc_symbol_nobody_defines" in import_results[
        "tvcfakeext._C"]
    assert "libtvcdep.so: cannot open shared object file" in import_results[
        "tvcfakeext._moe_C"]
    assert "ImportError" in import_results["tvcfakeext._flash_C"]


def test_compiled_extensions_load_fails_naming_cause_and_fix(fake_pkg) -> None:
    """Drive the suite's own assertion with the fake package (it needs hw_gpu)."""
    path = REPO_ROOT / "suites" / "level1" / "test_compiled_extensions.py"
    spec = importlib.util.spec_from_file_location("tvc_l1_ext", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = vllm_install.discover_extensions(fake_pkg / "tvcfakeext")
    props: dict[str, object] = {}
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(fake_pkg))
    try:
        with pytest.raises(AssertionError) as err:
            mod.test_compiled_extensions_load(names, props.__setitem__)
    finally:
        mp.undo()
    msg = str(err.value)
    assert "3 of 4 compiled extensions fail to load" in msg
    assert "tvcfakeext._C: ImportError" in msg
    assert "undefined symbol: a compiled extension was built against another" in msg
    assert "pip install -e . --no-build-isolation" in msg
    assert "library not found: a shared library the extension links" in msg
    assert props == {"extensions_loaded": 1, "extensions_failed": 3}


@pytest.mark.parametrize(("text", "cause"), [
    ("/x/_C.so: undefined symbol: _ZN3c10", "undefined symbol: "),
    ("libcudart.so.13: cannot open shared object file: No such file", "library not"),
    ("something else", "not a missing symbol or library"),
])
def test_explain_import_error(text: str, cause: str) -> None:
    assert vllm_install.explain_import_error(text).startswith(cause)


# ------------------------------------------- the connector's own extensions (level1)
#: a torch C++ symbol no library defines: c10::tvc_fake_missing()
C10_SYMBOL = "_ZN3c1016tvc_fake_missingEv"
BUILT_FOR = "torch==2.11.0"


@pytest.fixture(scope="module")
def fake_connector_site(tmp_path_factory) -> Path:
    """``tvcfakeconn`` 1.2.3 (Requires-Dist torch==2.11.0): a good extension and
    one built against a torch whose symbol is missing here; returns its site."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the fake extensions "
                    "(apt-get install gcc)")
    inc = sysconfig.get_paths()["include"]
    if not (Path(inc) / "Python.h").is_file():
        pytest.skip(f"Python.h is not in {inc}: cannot build the good fake extension "
                    "(install this Python's development headers)")
    from selftests.foundation.fakes import make_fake_distribution

    root = tmp_path_factory.mktemp("conn")
    src = root / "src"
    src.mkdir()
    (src / "ok.c").write_text(GOOD_EXT % ("_ok_C", "_ok_C"))
    _gcc("-shared", "-fPIC", f"-I{inc}", str(src / "ok.c"), "-o", str(src / "ok.so"))
    # each fails at dlopen, before its module init runs (which it names, as every
    # extension module does: PyInit_<name>)
    (src / "abi.c").write_text(f"extern int {C10_SYMBOL}(void);\n"
                               f"int tvc_calls(void) {{ return {C10_SYMBOL}(); }}\n"
                               "void *PyInit__C(void) { return 0; }\n")
    _gcc("-shared", "-fPIC", str(src / "abi.c"), "-o", str(src / "abi.so"))
    # a CUDA extension: links libc10_cuda.so, which a CPU build of torch lacks
    (src / "c10cuda.c").write_text("int tvc_dep_value(void) { return 1; }\n")
    _gcc("-shared", "-fPIC", str(src / "c10cuda.c"), "-o", str(src / "libc10_cuda.so"))
    (src / "cuda.c").write_text(NEEDS_LIB_EXT
                                + "void *PyInit_cuda_ops(void) { return 0; }\n")
    # a plain shared library beside them (Mooncake ships libasio.so): no module
    (src / "plain.c").write_text("int tvc_plain(void) { return 2; }\n")
    _gcc("-shared", "-fPIC", str(src / "plain.c"), "-o", str(src / "libplain.so"))
    _gcc("-shared", "-fPIC", str(src / "cuda.c"), f"-L{src}", "-lc10_cuda", "-o",
         str(src / "cuda.so"))
    (src / "libc10_cuda.so").unlink()
    site = root / "site"
    make_fake_distribution(site, "tvcfakeconn", "1.2.3", {
        "tvcfakeconn/__init__.py": "",
        f"tvcfakeconn/_ok_C{SUFFIX}": (src / "ok.so").read_bytes(),
        f"tvcfakeconn/ops/_C{SUFFIX}": (src / "abi.so").read_bytes(),
        "tvcfakeconn/ops/__init__.py": "",
        f"tvcfakeconn/cuda_ops{SUFFIX}": (src / "cuda.so").read_bytes(),
        "tvcfakeconn/libplain.so": (src / "libplain.so").read_bytes(),
        # another Python's build: not this interpreter's to load
        "tvcfakeconn/_x.cpython-39-x86_64-linux-gnu.so": b"",
    }, requires=(BUILT_FOR, "numpy"))
    return site


def _run_level1(tmp_path: Path, site: Path, **imports: object) -> object:
    from selftests.conftest import run_suite
    from selftests.foundation.fakes import minimal_profile, pythonpath

    prof = minimal_profile(tmp_path / "p.toml", tmp_path / "scratch",
                           imports=imports)
    return run_suite(["suites/level1/test_connector_resolves.py", "-p", "no:xdist",
                      "-k", "connector_extensions_load", f"--tvc-profile={prof}"],
                     tmp_path / "r", env={"PYTHONPATH": pythonpath(site, REPO_ROOT)})


def test_connector_extension_with_a_torch_abi_mismatch_fails_level1(
        tmp_path: Path, fake_connector_site: Path) -> None:
    """Found from the package's files: the good one loads, the ABI mismatch fails
    naming the symbol and the torch its distribution was built for."""
    run = _run_level1(tmp_path, fake_connector_site, modules=["tvcfakeconn"])
    ok = run.test("test_connector_extensions_load[tvcfakeconn._ok_C]")
    assert ok["outcome"] == "passed", run.tail()
    assert ok["properties"]["extension_distribution"] == "tvcfakeconn 1.2.3"
    bad = run.test("test_connector_extensions_load[tvcfakeconn.ops._C]")
    msg = bad["message"]
    assert bad["outcome"] == "failed", run.tail()
    assert f"`import tvcfakeconn.ops._C` failed with undefined symbol {C10_SYMBOL}" \
        in msg, msg
    if shutil.which("c++filt"):
        assert "(c10::tvc_fake_missing())" in msg, msg
    torch_here = md.version("torch")
    assert (f"it was built for another torch (tvcfakeconn 1.2.3 requires "
            f"{BUILT_FOR}); this Python has torch {torch_here}") in msg, msg
    cuda = run.test("test_connector_extensions_load[tvcfakeconn.cuda_ops]")
    if not run.summary["hardware"]["levels"]["gpu"]:  # one hardware skip, not red
        assert cuda["outcome"] == "skipped", run.tail()
        assert "tvcfakeconn.cuda_ops (tvcfakeconn 1.2.3) is a CUDA extension: it " \
            "links libc10_cuda.so" in cuda["message"], cuda["message"]
        assert "no CUDA GPU" in cuda["message"], cuda["message"]
    # neither the cpython-39 file nor the plain library is a module to import
    assert len(run.summary["tests"]) == 3, run.tail()


def test_connector_extensions_named_in_the_profile_are_the_ones_loaded(
        tmp_path: Path, fake_connector_site: Path) -> None:
    run = _run_level1(tmp_path, fake_connector_site,
                      extensions=["tvcfakeconn._ok_C", "tvcfakeconn._gone_C"])
    assert {t["nodeid"].split("[")[-1] for t in run.summary["tests"]} == {
        "tvcfakeconn._ok_C]", "tvcfakeconn._gone_C]"}, run.tail()
    assert run.test("[tvcfakeconn._ok_C]")["outcome"] == "passed"
    gone = run.test("[tvcfakeconn._gone_C]")
    assert gone["outcome"] == "failed", run.tail()
    assert "No module named 'tvcfakeconn._gone_C'" in gone["message"]
    assert "is in no installed distribution: check [imports] extensions" in \
        gone["message"]


def test_a_connector_without_extensions_skips_naming_why(tmp_path: Path) -> None:
    run = _run_level1(tmp_path, tmp_path)  # ExampleConnector: inside vLLM
    t = run.test("test_connector_extensions_load[none]")
    assert t["outcome"] == "skipped", t
    assert "names no compiled extension ([imports] extensions)" in t["message"]
