#!/usr/bin/env python3
"""Compiles a kernel source as stepgraph does (NVRTC 13, sm_90, common.cuh
prepended, -lineinfo) into CUBINs for timing harnesses on the GPU machine,
and prints ptxas's registers and spills per kernel. No GPU needed; uses the
NVRTC wheel that .ci/run installs (NVRTC_DIR, default ~/.cache/stepgraph/nvrtc-13.0).

    nvrtc_cubin.py SOURCE OUTDIR NAME[:FLAGS]...   # writes OUTDIR/NAME.cubin per variant
"""
import ctypes
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
KERNELS = os.path.join(ROOT, "crates", "cuda", "kernels")
NV = os.path.join(os.environ.get("NVRTC_DIR", os.path.expanduser("~/.cache/stepgraph/nvrtc-13.0")), "nvidia", "cu13")


def _lib():
    # libnvrtc loads its builtins library by name: put the wheel's lib dir first.
    os.environ["LD_LIBRARY_PATH"] = os.path.join(NV, "lib") + ":" + os.environ.get("LD_LIBRARY_PATH", "")
    ctypes.CDLL(os.path.join(NV, "lib", "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(os.path.join(NV, "lib", "libnvrtc.so.13"))


def compile_source(src, flags, cubin_path=None):
    """(return code, ptxas log) of compiling `src` (common.cuh is prepended) with `flags`."""
    lib = _lib()
    full = open(os.path.join(KERNELS, "common.cuh")).read() + "\n" + src
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), full.encode(), b"k.cu", 0, None, None) == 0
    # sm_90 as stepgraph builds, unless the flags name another target (sm_90a for wgmma).
    arch = [] if any(f.startswith("--gpu-architecture") for f in flags) else [b"--gpu-architecture=sm_90"]
    opts = arch + [b"--std=c++17", b"-lineinfo", b"--ptxas-options=-v",
                   ("--include-path=" + os.path.join(NV, "include")).encode()] + [f.encode() for f in flags]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc == 0 and cubin_path:
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, out)
        open(cubin_path, "wb").write(out.raw)
    return rc, log.value.decode()


def report(name, log):
    """One line per kernel: registers and spills."""
    fn, spill = None, ""
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            fn = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spill = f"stack {m.group(1)} spill {m.group(2)}/{m.group(3)}"
        m = re.search(r"Used (\d+) registers", line)
        if m and fn:
            print(f"{name:12} {fn:36} regs {m.group(1):>3}  {spill}")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    source, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    for spec in sys.argv[3:]:
        name, _, flags = spec.partition(":")
        rc, log = compile_source(open(source).read(), flags.split(), os.path.join(outdir, name + ".cubin"))
        if rc != 0:
            sys.exit(f"{name}: FAILED\n{log}")
        report(name, log)
