"""The extension's compiler choice (engine/kernels/toolchain.py): the ELF reader against real
shared objects, and a compiler wrapper that links libstdc++ statically (as the device
image's does) passed over for the system's g++."""

from __future__ import annotations

import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import toolchain

GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None or not sys.platform.startswith("linux"),
                               reason="needs g++ on Linux")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF files on Linux")
def test_needed_libraries_reads_torchs_libraries(tmp_path):
    needed = toolchain.needed_libraries(torch._C.__file__)
    assert "libtorch_python.so" in needed, needed
    cpu = next(Path(torch.__file__).parent.glob("lib/libtorch_cpu.so*"))
    assert "libstdc++.so.6" in toolchain.needed_libraries(cpu)
    assert toolchain.links_shared_cxx_runtime(cpu)
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        toolchain.needed_libraries(torch.__file__)  # a .py file
    data = Path(torch._C.__file__).read_bytes()
    cut = tmp_path / "cut.so"
    for n in (4, 64, 600):  # truncated: a clear error, never an IndexError / struct.error
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError):
            toolchain.needed_libraries(cut)


@needs_gxx
def test_needed_libraries_of_an_object_without_a_dynamic_segment(tmp_path):
    import subprocess

    (tmp_path / "a.cpp").write_text("int f() { return 1; }\n")
    subprocess.run([GXX, "-c", "-o", str(tmp_path / "a.o"), str(tmp_path / "a.cpp")],
                   check=True)
    with pytest.raises(ValueError, match="no dynamic segment"):
        toolchain.needed_libraries(tmp_path / "a.o")


def _static_wrapper(tmp_path: Path) -> str:
    """A g++ that links libstdc++ statically, like /opt/gcc/bin/g++ on the device."""
    w = tmp_path / "static-g++"
    w.write_text(f'#!/bin/sh\nexec {GXX} -static-libstdc++ "$@"\n')
    w.chmod(w.stat().st_mode | stat.S_IEXEC)
    return str(w)


@needs_gxx
def test_probe_tells_a_static_runtime_from_the_shared_one(tmp_path):
    assert toolchain.probe(GXX) is None
    why = toolchain.probe(_static_wrapper(tmp_path))
    assert why is not None and "statically" in why
    assert "did not run" in toolchain.probe(str(tmp_path / "no-such-g++"))


@needs_gxx
def test_choose_passes_over_a_static_compiler_for_the_systems(tmp_path):
    static = _static_wrapper(tmp_path)
    gcc = shutil.which("gcc") or "gcc"
    tc, why = toolchain.choose({"CC": "/opt/x/gcc", "CXX": static}, system=(gcc, GXX))
    assert tc == toolchain.Toolchain(gcc, GXX) and len(why) == 1 and "statically" in why[0]
    # the environment's compiler first when it links the shared runtime; without CC, nvcc's
    # host compiler is that same one
    tc, why = toolchain.choose({"CXX": GXX}, system=(gcc, GXX))
    assert tc == toolchain.Toolchain(GXX, GXX) and why == []
    # nothing usable: None, and every reason
    tc, why = toolchain.choose({"CXX": static}, system=(gcc, str(tmp_path / "none")))
    assert tc is None and len(why) == 1
    # different compilers, different build-cache keys
    assert toolchain.Toolchain(gcc, GXX).key != toolchain.Toolchain(gcc, static).key


def test_environ_sets_and_restores(monkeypatch):
    monkeypatch.setenv("CC", "/keep/cc")
    monkeypatch.delenv("CXX", raising=False)
    import os

    with pytest.raises(RuntimeError), toolchain.Toolchain("/x/gcc", "/x/g++").environ():
        assert (os.environ["CC"], os.environ["CXX"]) == ("/x/gcc", "/x/g++")
        raise RuntimeError("the build failed")
    assert os.environ["CC"] == "/keep/cc" and "CXX" not in os.environ


def _built(tmp_path: Path, cxx: str) -> str:
    """A shared object linked by `cxx`, standing in for a built extension."""
    import subprocess

    src, out = tmp_path / "ext.cpp", tmp_path / f"ext-{Path(cxx).name}.so"
    src.write_text("#include <string>\nstd::string f(long n) { return std::to_string(n); }\n")
    subprocess.run([cxx, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return str(out)


@pytest.fixture
def fresh_build():  # type: ignore[no-untyped-def]
    """build's cached result cleared before and after (a failing test leaves none behind)."""
    from engine.kernels import build

    def clear() -> None:
        build.extension_path.cache_clear()
        build._build.cache_clear()

    clear()
    yield clear
    clear()


@needs_gxx
def test_build_refuses_an_extension_with_its_own_libstdcxx(tmp_path, monkeypatch, caplog,
                                                           fresh_build):
    """extension_path's checks around torch's build (faked: no CUDA here): a build whose
    output carries a static libstdc++ is not used; neither is one with no compiler at all;
    a good one is, built with the chosen compilers in CC / CXX."""
    import types

    import torch.utils.cpp_extension as cpp

    from engine.kernels import build

    static = _static_wrapper(tmp_path)
    seen = {}

    def fake_load(name, sources, extra_cflags, extra_cuda_cflags, verbose):  # type: ignore[no-untyped-def]
        import os

        seen.update(cxx=os.environ.get("CXX"), flags=extra_cuda_cflags)
        return types.SimpleNamespace(__file__=_built(tmp_path, os.environ["CXX"]))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setattr(torch.ops, "rtvoice_kernels",
                        types.SimpleNamespace(**dict.fromkeys(build.KERNEL_OPS, 1)),
                        raising=False)
    cases = [(toolchain.Toolchain(static, static), "carry their own copy of libstdc++", False),
             (None, "no C++ compiler here links the shared libstdc++", False),
             (toolchain.Toolchain(GXX, GXX), "loaded (sm_90, built by", True)]
    import os

    monkeypatch.setenv("CC", "/env/cc")
    monkeypatch.setenv("CXX", "/env/c++")
    for tc, said, ok in cases:
        fresh_build()
        monkeypatch.setattr(toolchain, "choose", lambda tc=tc: (tc, []))
        caplog.clear()
        with caplog.at_level("INFO", logger="engine.kernels.build"):
            path = build.extension_path()
        assert (path is not None) == ok and said in caplog.text, caplog.text
        assert build.extension_available() == ok
        if tc is not None:
            assert seen["cxx"] == tc.cxx and f"-DRTV_TOOLCHAIN={tc.key}" in seen["flags"]
        # the build's compilers were set for it only
        assert (os.environ["CC"], os.environ["CXX"]) == ("/env/cc", "/env/c++")
