#!/usr/bin/env python3
"""Registers, spills and shared memory of each attention variant, from NVRTC's
ptxas report (no GPU needed): regs.py NAME:FLAGS... With CUBIN_DIR set, also
writes each variant's CUBIN there (NAME-dDP.cubin), compiled as stepgraph
compiles it, for run.sh to time (ATTN_SRC picks another source file).
Needs the NVRTC wheel that .ci/run installs (NVRTC_DIR, default ~/.cache/stepgraph/nvrtc-13.0)."""
import ctypes, os, re, sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
nv = os.path.join(os.environ.get("NVRTC_DIR", os.path.expanduser("~/.cache/stepgraph/nvrtc-13.0")), "nvidia", "cu13")
lib = ctypes.CDLL(os.path.join(nv, "lib", "libnvrtc.so.13"))
kernels = os.path.join(root, "crates", "cuda", "kernels")
src_path = os.environ.get("ATTN_SRC", os.path.join(kernels, "attention_mma.cu"))
common = open(os.path.join(kernels, "common.cuh")).read()


def compile_variant(flags, dp, cubin_path=None):
    src = common + "\n#define SGM_SFX bf16\n#define SGM_TYPE __nv_bfloat16\n#define SGM_DP %d\n" % dp + open(src_path).read()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"a.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"-lineinfo", b"--ptxas-options=-v",
            ("--include-path=" + os.path.join(nv, "include")).encode()] + [f.encode() for f in flags]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    if rc == 0 and cubin_path:
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, out)
        open(cubin_path, "wb").write(out.raw)
    return rc, buf.value.decode()


for spec in sys.argv[1:]:
    name, _, flags = spec.partition(":")
    for dp in (int(d) for d in os.environ.get("DPS", "112,128").split(",")):
        cubin = os.path.join(os.environ["CUBIN_DIR"], f"{name}-d{dp}.cubin") if os.environ.get("CUBIN_DIR") else None
        rc, log = compile_variant(flags.split() if flags else [], dp, cubin)
        if rc != 0:
            print(f"{name} d{dp}: FAILED\n{log}")
            continue
        fn = None
        for line in log.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                fn = m.group(1).replace("attention_mma_", "")
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m and fn:
                spill = f"stack {m.group(1)} spill {m.group(2)}/{m.group(3)}"
            m = re.search(r"Used (\d+) registers", line)
            if m and fn:
                print(f"{name:12} {fn:16} regs {m.group(1):>3}  {spill}")
