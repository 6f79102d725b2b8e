"""The build refuses an extension that carries its own libstdc++.

A compiler that links libstdc++ statically into shared libraries (a wrapper
adding ``-static-libstdc++``) gives the extension a second libstdc++ beside
torch's; on a GPU machine every TORCH_CHECK whose message held a number then
crashed. ``cmake/check_shared_libstdcxx.cmake`` runs after the link
(CMakeLists.txt) and fails the build on such a library; here it is run on
two small libraries, one of each kind, built with the machine's g++.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "cmake" / "check_shared_libstdcxx.cmake"
TOOLS = {name: shutil.which(name) for name in ("g++", "cmake", "nm")}
pytestmark = pytest.mark.skipif(not all(TOOLS.values()), reason=f"needs g++, cmake and nm: {TOOLS}")

SOURCE = """
#include <sstream>
#include <string>
std::string format(long x) { std::ostringstream o; o << x; return o.str(); }
"""


def _check(lib: Path) -> subprocess.CompletedProcess:
    return subprocess.run([TOOLS["cmake"], f"-DLIB={lib}", f"-DNM={TOOLS['nm']}", "-DCXX=g++", "-P", str(SCRIPT)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("static", [False, True], ids=["shared-libstdc++", "static-libstdc++"])
def test_check_refuses_a_private_libstdcxx(tmp_path, static):
    src = tmp_path / "fmt.cpp"
    src.write_text(SOURCE)
    lib = tmp_path / "libfmt.so"
    flags = ["-static-libstdc++"] if static else []
    subprocess.run([TOOLS["g++"], "-shared", "-fPIC", "-o", str(lib), str(src), *flags], check=True, timeout=120)
    r = _check(lib)
    if static:
        assert r.returncode != 0
        assert "linked libstdc++ statically" in r.stderr and "CXX=" in r.stderr
        assert not lib.exists()  # removed, so nothing installs it
    else:
        assert r.returncode == 0, r.stderr
        assert lib.exists()


def test_the_build_runs_the_check():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert "POST_BUILD" in cmake and SCRIPT.name in cmake
