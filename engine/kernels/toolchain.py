"""Which C/C++ compilers build csrc's extension: ones that link the shared C++ runtime.

torch itself runs on the system's shared `libstdc++.so.6`. An extension linked with a
private, static copy of libstdc++ (as the device image's `CC=/opt/gcc/bin/gcc
CXX=/opt/gcc/bin/g++` link them: how they do it was not examined) carries a second copy of
the runtime's locale tables, half bound to torch's copy at load time: formatting a number
into a stream — every `TORCH_CHECK` message with an int in it — then crashes the process
(SIGSEGV) instead of raising (2026-12-05, H100 and H200, torch 2.11: found with a debugger's
backtrace through `basic_ostream::_M_insert<long>` inside the extension). So before the
build, a two-line shared object is linked with each candidate (the environment's CXX, then
the system's g++) and the first whose output needs `libstdc++.so` is used; after it, the
extension's own dependencies are checked the same way.

Linux/ELF only (where the extension builds: CUDA machines); `needed_libraries` reads the
ELF dynamic segment directly, as the loader does (no binutils needed).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

SYSTEM = ("/usr/bin/gcc", "/usr/bin/g++")  # Debian/Ubuntu's compilers: the shared runtime
_PROBE = ('#include <sstream>\n#include <string>\n'
          'std::string rtv_probe(long n) { std::ostringstream s; s << n; return s.str(); }\n')


def needed_libraries(path: str | os.PathLike[str]) -> list[str]:
    """The DT_NEEDED entries (the shared libraries it links) of a 64-bit little-endian ELF
    file, read as the loader reads them: its PT_DYNAMIC segment, the string table found by
    address through the PT_LOAD segments. Raises ValueError for anything else (not ELF,
    truncated, no dynamic segment: a static or relocatable file)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    try:
        phoff, = struct.unpack_from("<Q", data, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
        # (p_type, p_offset, p_vaddr, p_filesz) of each program header
        segs = [struct.unpack_from("<I4xQQ8xQ", data, phoff + i * phentsize)
                for i in range(phnum)]
        dyn = next(((off, size) for t, off, _, size in segs if t == 2), None)  # PT_DYNAMIC
        if dyn is None:
            raise ValueError(f"{path}: no dynamic segment (not a shared object)")
        entries = [struct.unpack_from("<qQ", data, pos)
                   for pos in range(dyn[0], dyn[0] + dyn[1] - 15, 16)]
        entries = entries[:next((i for i, (tag, _) in enumerate(entries) if tag == 0),
                                len(entries))]  # DT_NULL ends the table
        strtab = next((v for tag, v in entries if tag == 5), None)  # DT_STRTAB, an address
        strsz = next((v for tag, v in entries if tag == 10), 0)  # DT_STRSZ
        base = next((off + strtab - va for t, off, va, size in segs
                     if t == 1 and strtab is not None and va <= strtab < va + size), None)
        if base is None:
            raise ValueError(f"{path}: its dynamic string table is not in a loaded segment")
        out = []
        for tag, val in entries:
            if tag == 1:  # DT_NEEDED: an offset into the string table
                if val >= strsz:
                    raise ValueError(f"{path}: a DT_NEEDED name past its string table")
                out.append(data[base + val:data.index(b"\0", base + val)].decode())
        return out
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: a malformed ELF file ({e})") from e


def links_shared_cxx_runtime(path: str | os.PathLike[str]) -> bool:
    """Whether the shared object at `path` uses the shared libstdc++ (not a copy of its own)."""
    return any(n.startswith("libstdc++.so") for n in needed_libraries(path))


def probe(cxx: str) -> str | None:
    """Link a small shared object that formats a number with `cxx`: None when its output
    uses the shared libstdc++, else why this compiler will not do."""
    with tempfile.TemporaryDirectory(prefix="rtvoice-cxx-") as d:
        src, out = Path(d) / "probe.cpp", Path(d) / "probe.so"
        src.write_text(_PROBE)
        try:
            r = subprocess.run([cxx, "-shared", "-fPIC", "-o", str(out), str(src)],
                               capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{cxx} did not run ({e})"
        if r.returncode != 0:
            return f"{cxx} failed to link a shared object: {r.stderr.strip()[-300:]}"
        try:
            shared = links_shared_cxx_runtime(out)
        except ValueError as e:
            return f"{cxx} made a shared object this check cannot read ({e})"
        if not shared:
            return (f"{cxx} links libstdc++ statically into shared objects (a second copy of "
                    "torch's C++ runtime: an error message with a number in it would crash "
                    "the process)")
    return None


@dataclass(frozen=True, slots=True)
class Toolchain:
    cc: str  # nvcc's host compiler (-ccbin): the same family as cxx, so objects and link agree
    cxx: str  # compiles ops.cpp and links the extension

    @property
    def key(self) -> str:
        """A short hash of the compilers (resolved paths, modification times), for the build
        flags: torch versions its extension cache by sources and flags, so a build by other
        compilers (a changed CXX, an upgraded or re-pointed g++) is a version of its own."""
        return hashlib.sha256("\0".join(map(_identity, (self.cc, self.cxx))).encode()
                              ).hexdigest()[:12]

    @contextlib.contextmanager
    def environ(self) -> Iterator[None]:
        """CC / CXX set to these compilers for the duration (torch's build reads them)."""
        want = {"CC": self.cc, "CXX": self.cxx}
        saved = {k: os.environ.get(k) for k in want}
        try:
            _set_environ(want)
            yield
        finally:
            _set_environ(saved)


def _identity(exe: str) -> str:
    """A compiler's resolved path and modification time (its name where it is not found)."""
    found = shutil.which(exe)
    if found is None:
        return exe
    real = os.path.realpath(found)
    return f"{real}@{os.stat(real).st_mtime_ns}"


def _set_environ(values: Mapping[str, str | None]) -> None:
    """Set these environment variables (None: unset)."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def choose(env: Mapping[str, str] | None = None,
           system: tuple[str, str] = SYSTEM) -> tuple[Toolchain | None, list[str]]:
    """The first toolchain whose C++ compiler links the shared libstdc++: the environment's
    (CXX, torch's `c++` when unset; CC, else that same compiler, as nvcc's host compiler),
    then the system's gcc / g++ where present. Returns (it or None, why each one tried before
    it was passed over)."""
    env = os.environ if env is None else env
    cxx = env.get("CXX") or "c++"
    cands = [Toolchain(env.get("CC") or cxx, cxx)]
    if Path(system[1]).exists():
        cands.append(Toolchain(system[0] if Path(system[0]).exists() else system[1], system[1]))
    why: list[str] = []
    for tc in dict.fromkeys(cands):
        reason = probe(tc.cxx)
        if reason is None:
            return tc, why
        why.append(reason)
    return None, why
