"""Build of rl_kernels._C: one CPython extension from C (binding + CPU kernels) and CUDA C kernels.

- .c files: the C compiler, C11, -O3, OpenMP, -ffp-contract=off (no silent FMA contraction, so
  the CPU reduction order is exactly the one written in the source).
- .cu files: nvcc, in parallel; flags by file suffix:
    *_sm80.cu -> sm_80 SASS + compute_80 PTX (+ sm_90 SASS so Hopper does not JIT the PTX)
    *_sm90.cu -> sm_90a SASS (wgmma, setmaxnreg, TMA)
  each compiled file defines RLK_HAVE_<FILE STEM> for csrc/module.c.
- CUDA runtime linked statically, -lineinfo. No libtorch, no pybind11.
- No nvcc, or RL_KERNELS_CPU_ONLY=1: a CPU-only _C (the package reports CUDA backends as
  "not compiled").
- DLPack's header comes from the installed torch (include/ATen/dlpack.h), located without importing
  torch; hence `pip install --no-build-isolation`.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"

ARCH_FLAGS = {
    "_sm80": [
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_80,code=compute_80",
        "-gencode", "arch=compute_90,code=sm_90",
    ],
    "_sm90": ["-gencode", "arch=compute_90a,code=sm_90a"],
}


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


def arch_flags(source: Path):
    for suffix, flags in ARCH_FLAGS.items():
        if source.stem.endswith(suffix):
            return flags
    raise RuntimeError(f"{source}: CUDA files must end in one of {sorted(ARCH_FLAGS)}")


class BuildExt(build_ext):
    """Compiles .cu files with nvcc (in parallel) and hands the objects to the normal link."""

    def build_extension(self, ext):
        nvcc = find_nvcc()
        cu_sources = sorted(p for p in CSRC.glob("cuda/*.cu") if not p.name.startswith(".")) \
            if nvcc else []
        include = torch_include_dir()
        ext.include_dirs += [str(CSRC), include]
        if cu_sources:
            cuda_home = Path(nvcc).resolve().parent.parent
            ext.include_dirs.append(str(cuda_home / "include"))
            ext.define_macros.append(("RLK_WITH_CUDA", "1"))
            ext.define_macros += [(f"RLK_HAVE_{s.stem.upper()}", "1") for s in cu_sources]
            cuda_objects = self.compile_cuda(nvcc, cu_sources, include)
            ext.extra_objects += cuda_objects
            ext.depends += cuda_objects  # relink when only a CUDA object changed
            ext.library_dirs.append(str(cuda_home / "lib64"))
            ext.libraries += ["cudart_static", "rt", "pthread", "dl", "stdc++"]
        super().build_extension(ext)

    def compile_cuda(self, nvcc, sources, torch_include):
        build_dir = Path(self.build_temp) / "cuda"
        build_dir.mkdir(parents=True, exist_ok=True)

        def compile_one(source: Path) -> str:
            obj = build_dir / (source.stem + ".o")
            if obj.exists() and obj.stat().st_mtime > max(
                p.stat().st_mtime for p in [source, *CSRC.glob("*.h"), *CSRC.glob("cuda/*.cuh")]
            ):
                return str(obj)
            cmd = [nvcc, "-c", str(source), "-o", str(obj), "-O3", "-std=c++17", "-lineinfo",
                   "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-Xptxas", "-v",
                   f"-I{CSRC}", f"-I{torch_include}", *arch_flags(source)]
            print(" ".join(cmd), flush=True)
            result = subprocess.run(cmd, capture_output=True, text=True)
            log = build_dir / (source.stem + ".ptxas.log")
            log.write_text(result.stdout + result.stderr)
            if result.returncode != 0:
                raise RuntimeError(f"nvcc failed on {source.name}:\n{result.stderr[-8000:]}")
            return str(obj)

        jobs = int(os.environ.get("RL_KERNELS_NVCC_JOBS", os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(compile_one, sources))


c_sources = sorted(str(p.relative_to(ROOT)) for p in [*CSRC.glob("*.c"), *CSRC.glob("cpu/*.c")])

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
