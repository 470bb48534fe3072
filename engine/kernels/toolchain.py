"""Which C/C++ compilers build csrc's extension: ones that link the shared C++ runtime.

torch itself runs on the system's shared `libstdc++.so.6`. An extension linked with a
private, static copy of libstdc++ (a compiler wrapper that adds `-static-libstdc++`, as the
H200 device image's `CC=/opt/gcc/bin/gcc CXX=/opt/gcc/bin/g++` do) carries a second copy of
the runtime's locale tables, half bound to torch's copy at load time: formatting a number
into a stream — every `TORCH_CHECK` message with an int in it — then crashes the process
(SIGSEGV) instead of raising (2026-12-05, H100 and H200, torch 2.11: found with a debugger's
backtrace through `basic_ostream::_M_insert<long>` inside the extension). So before the
build, a two-line shared object is linked with each candidate (the environment's CXX, then
the system's g++) and the first whose output needs `libstdc++.so` is used; after it, the
extension's own dependencies are checked the same way.

Linux/ELF only (where the extension builds: CUDA machines); `needed_libraries` reads the
ELF dynamic section directly (no binutils needed).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
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
    """The DT_NEEDED entries (shared libraries it links) of a 64-bit little-endian ELF file.
    Raises ValueError for anything else."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    out: list[str] = []
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC; sh_link: its string table's section
            continue
        stroff = sections[link][4]
        for pos in range(off, off + size, entsize or 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL ends the table
                break
            if tag == 1:  # DT_NEEDED: an offset into the string table
                end = data.index(b"\0", stroff + val)
                out.append(data[stroff + val:end].decode())
    return out


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
        if not links_shared_cxx_runtime(out):
            return (f"{cxx} links libstdc++ statically into shared objects (a second copy of "
                    "torch's C++ runtime: an error message with a number in it would crash "
                    "the process)")
    return None


@dataclass(frozen=True, slots=True)
class Toolchain:
    cc: str | None  # None: torch's default (nvcc's own host compiler lookup)
    cxx: str

    @property
    def key(self) -> str:
        """A short hash of the compilers, for the build flags: torch's extension cache
        hashes sources and flags only, so a different compiler must change a flag."""
        return hashlib.sha256(f"{self.cc}\0{self.cxx}".encode()).hexdigest()[:12]

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
    (CC / CXX, torch's `c++` when CXX is unset), then the system's gcc / g++ where present.
    Returns (it or None, why each one tried before it was passed over)."""
    env = os.environ if env is None else env
    cands = [Toolchain(env.get("CC"), env.get("CXX") or "c++")]
    if Path(system[1]).exists():
        cands.append(Toolchain(system[0] if Path(system[0]).exists() else None, system[1]))
    why: list[str] = []
    for tc in dict.fromkeys(cands):
        reason = probe(tc.cxx)
        if reason is None:
            return tc, why
        why.append(reason)
    return None, why
