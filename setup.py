"""Build of rl_kernels._C: one CPython extension from C (binding + CPU kernels) and CUDA C kernels.

What is built comes from csrc/kernels.def, the one list of backends and kernels:
- the binding (csrc/module.c, csrc/bind/*.c) and every .c source of a KERNEL row: the C compiler,
  C11, -O3, OpenMP, -ffp-contract=off (no silent FMA contraction, so the CPU reduction order is
  exactly the one written in the source);
- every .cu source of a KERNEL row: nvcc, in parallel, with the -gencode values of its backend's
  BACKEND row, one line printed per object and a summary at the end. csrc/cuda/sm90/wgmma_gen.py
  writes the wgmma header those kernels include into the build tree first.
- CUDA runtime linked statically, -lineinfo. No libtorch, no pybind11.
- No nvcc, or RL_KERNELS_CPU_ONLY=1: a CPU-only _C (the CUDA backends report "not compiled").
- DLPack's header comes from the installed torch (include/ATen/dlpack.h), located without importing
  torch; hence `pip install --no-build-isolation`.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"


def kernel_list():
    """(backends {name: (device, gencode values)}, kernels [(entry, backend, source)]) of kernels.def."""
    text = (CSRC / "kernels.def").read_text()
    backends = {name: (device, gencode.split()) for name, device, gencode in re.findall(
        r'^BACKEND\((\w+),\s*(\w+),[^"]*"([^"]*)"\)', text, re.M)}
    kernels = re.findall(r'^KERNEL\((\w+),\s*(\w+),\s*"([^"]+)"\)', text, re.M)
    for entry, backend, source in kernels:
        if backend not in backends or not (CSRC / source).exists():
            sys.exit(f"csrc/kernels.def: KERNEL({entry}, {backend}, {source}): unknown backend or missing file")
    return backends, kernels


def torch_include_dir() -> str:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("rl_kernels needs an installed torch at build time for DLPack's header "
                 "(pip install torch, then pip install --no-build-isolation .)")
    include = Path(list(spec.submodule_search_locations)[0]) / "include"
    if not (include / "ATen" / "dlpack.h").exists():
        sys.exit(f"DLPack header not found under {include}/ATen/dlpack.h")
    return str(include)


def find_nvcc():
    if os.environ.get("RL_KERNELS_CPU_ONLY", "0") == "1":
        return None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


BACKENDS, KERNELS = kernel_list()


def sources(device):
    """The distinct kernel sources of the backends on `device`, each with its backend."""
    found = {}
    for _, backend, source in KERNELS:
        if BACKENDS[backend][0] == device:
            found.setdefault(source, backend)
    return sorted(found.items())


class BuildExt(build_ext):
    """Compiles the .cu sources with nvcc (in parallel) and hands the objects to the normal link."""

    def build_extension(self, ext):
        nvcc = find_nvcc()
        include = torch_include_dir()
        ext.include_dirs += [str(CSRC), include]
        cu_sources = sources("cuda") if nvcc else []
        if cu_sources:
            cuda_home = Path(nvcc).resolve().parent.parent
            ext.include_dirs.append(str(cuda_home / "include"))
            ext.define_macros.append(("RLK_WITH_CUDA", "1"))
            cuda_objects = self.compile_cuda(nvcc, cu_sources, include)
            ext.extra_objects += cuda_objects
            ext.depends += cuda_objects  # relink when only a CUDA object changed
            ext.library_dirs.append(str(cuda_home / "lib64"))
            ext.libraries += ["cudart_static", "rt", "pthread", "dl", "stdc++"]
        elif not nvcc:
            print("rl_kernels: no nvcc (or RL_KERNELS_CPU_ONLY=1): building the CPU backend only",
                  flush=True)
        super().build_extension(ext)

    def compile_cuda(self, nvcc, cu_sources, torch_include):
        build_dir = Path(self.build_temp) / "cuda"
        generated = Path(self.build_temp) / "generated"
        sys.path.insert(0, str(CSRC / "cuda" / "sm90"))
        import wgmma_gen  # noqa: E402  (the generator lives beside the kernels that use it)
        wgmma_gen.write(generated)
        headers = [*CSRC.glob("*.h"), *CSRC.glob("ops/*.h"), *CSRC.glob("cuda/**/*.cuh"),
                   generated / "wgmma_shapes.cuh"]
        newest_header = max(p.stat().st_mtime for p in headers)
        print(f"rl_kernels: compiling {len(cu_sources)} CUDA sources with {nvcc} "
              f"(RL_KERNELS_CPU_ONLY=1 skips them)", flush=True)

        def compile_one(item):
            source, backend = item
            obj = build_dir / (source.replace("/", "_").removesuffix(".cu") + ".o")
            obj.parent.mkdir(parents=True, exist_ok=True)
            if obj.exists() and obj.stat().st_mtime > max(newest_header, (CSRC / source).stat().st_mtime):
                return str(obj), 0.0
            start = time.time()
            gencode = [f"-gencode={value}" for value in BACKENDS[backend][1]]
            cmd = [nvcc, "-c", str(CSRC / source), "-o", str(obj), "-O3", "-std=c++17", "-lineinfo",
                   "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-Xptxas", "-v",
                   f"-I{CSRC}", f"-I{generated}", f"-I{torch_include}", *gencode]
            result = subprocess.run(cmd, capture_output=True, text=True)
            obj.with_suffix(".ptxas.log").write_text(result.stdout + result.stderr)
            if result.returncode != 0:
                raise RuntimeError(f"nvcc failed on {source}:\n{result.stderr[-8000:]}")
            print(f"  nvcc {source} ({backend}): {time.time() - start:.0f} s", flush=True)
            return str(obj), time.time() - start

        jobs = int(os.environ.get("RL_KERNELS_NVCC_JOBS", os.cpu_count() or 1))
        start = time.time()
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            built = list(pool.map(compile_one, cu_sources))
        fresh = sum(1 for _, seconds in built if seconds > 0)
        print(f"rl_kernels: {fresh} CUDA objects compiled, {len(built) - fresh} up to date "
              f"({time.time() - start:.0f} s)", flush=True)
        return [obj for obj, _ in built]


c_sources = sorted({str(p.relative_to(ROOT)) for p in [CSRC / "module.c", *CSRC.glob("bind/*.c")]} |
                   {f"csrc/{source}" for source, _ in sources("cpu")})

setup(
    ext_modules=[
        Extension(
            "rl_kernels._C",
            sources=c_sources,
            extra_compile_args=["-std=c11", "-O3", "-fopenmp", "-ffp-contract=off",
                                "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
