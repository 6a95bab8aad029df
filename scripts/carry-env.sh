# Sourced by the GPU-machine scripts (gpu-test.sh, gpu-compare.sh) from the
# repository root: `carry_unpack` unpacks what `gpu-test.sh build` packed and
# exports where the kernel cache and NCCL are, in the caller's shell.
# shellcheck shell=bash

# The packed binaries and kernel cache, unpacked once per machine.
carry_unpack() {
    if [ -e .carry/pack.tar.xz ] && [ ! -e .carry/stepgraph ]; then
        tar -C .carry -xJf .carry/pack.tar.xz
    fi
    if [ -d .carry/kcache ]; then
        export STEPGRAPH_KERNEL_CACHE=$PWD/.carry/kcache
    fi
    # NCCL for the data-parallel tests: PyTorch's nvidia-nccl wheel, unless
    # STEPGRAPH_NCCL or LD_LIBRARY_PATH already provide libnccl.so.2.
    if [ -z "${STEPGRAPH_NCCL:-}" ]; then
        local nccl
        nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
        if [ -z "$nccl" ] || [ ! -e "$nccl/libnccl.so.2" ]; then
            nccl=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib 2>/dev/null | head -n 1 || true)
        fi
        if [ -n "$nccl" ] && [ -e "$nccl/libnccl.so.2" ]; then
            export STEPGRAPH_NCCL=$nccl
            echo "NCCL: $nccl" >&2
        fi
    fi
}
