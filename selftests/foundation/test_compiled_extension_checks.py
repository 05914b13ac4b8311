"""level1 compiled-extension checks against fake packages with broken ``.so`` files.

The suite's ``test_compiled_extensions_load`` needs a GPU (hw_gpu), so here its helpers
(:func:`discover_extensions`, :func:`import_extensions`) and its assertion are driven
directly with fake extensions built by gcc in a temp dir. The missing ``_C`` case runs
through the suite in test_vllm_install_checks.py.
"""

from __future__ import annotations

import importlib.machinery
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
