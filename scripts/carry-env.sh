# Sourced by scripts/gpu-*.sh from the repository root.
#
# The `.carry/` folder is what `scripts/gpu-test.sh build` leaves: the
# release CLI, the CUDA test binaries and the NVRTC kernel cache, packed as
# .carry/pack.tar.xz. It serves two set-ups alike: a machine with both a Rust
# toolchain and a GPU (build and run in the same checkout), and building on
# one machine and running on another (a GPU machine without a Rust
# toolchain): copy the repository with its `.carry/` folder there.
#
# `carry_unpack` unpacks the pack once and exports where the kernel cache
# and NCCL are, in the caller's shell; `gpu_script_start` does that and the
# rest every script starts with; `log_start`, `stamp` and `torch_rows` are
# the logging and PyTorch-reference steps the scripts share.
# shellcheck shell=bash

# The start of a GPU script: the results folder $RESULTS (default ./gpu-out)
# made, the pack unpacked, $SG the CLI (default .carry/stepgraph).
gpu_script_start() {
    RESULTS=${RESULTS:-gpu-out}
    mkdir -p "$RESULTS"
    carry_unpack
    SG=${SG:-.carry/stepgraph}
}

# `log_start FILE` empties FILE, makes it $LOG and starts the clock; `stamp
# WORDS` prints `== +Ns WORDS` (seconds since) and appends it to $LOG.
log_start() {
    LOG=$1
    : >"$LOG"
    T0=$(date +%s)
}
stamp() { echo "== +$(($(date +%s) - T0))s $*" | tee -a "$LOG"; }

# One PyTorch reference under a time limit: `torch_rows TAG SECONDS SCRIPT
# ARGS...` runs scripts/SCRIPT (torch_reference.py or torch_generate.py),
# appends all it prints to $LOG, and prints its RESULT rows as JSON, with `"switch": TAG` first unless TAG is
# empty. What finished before the limit is kept.
torch_rows() {
    local tag=$1 limit=$2 script=$3
    shift 3
    PYTHONUNBUFFERED=1 timeout "$limit" python3 "scripts/$script" "$@" 2>&1 | tee -a "$LOG" |
        grep '^RESULT ' | if [ -n "$tag" ]; then sed "s/^RESULT {/{\"switch\":\"$tag\",/"; else sed 's/^RESULT //'; fi
}

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
