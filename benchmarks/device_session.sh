#!/usr/bin/env bash
# The GPU measurements the open leads wait on, in the order of what they settle, each under a
# time limit of its own (530 s in all, under the 600 s a lent machine gives one call), so that
# one call runs them and keeps whatever finished:
#
#   bash benchmarks/device_session.sh OUT_DIR [HBM_BYTES_PER_S]
#
# 1. memory-bound kernels timed alone, and the median share of the datasheet's bandwidth they
#    reach (a preset's memory_efficiency, by benchmarks/memory_kernel_rates.py's rule);
# 2. this device's GEMM curve, copy rate and kernel gap (benchmarks/calibrate_gpu.py);
# 3. a layer's GEMMs one at a time and back to back for seconds (benchmarks/sustained_load.py);
# 4. whole blocks forward and backward, fresh and back to back at the power cap, with PyTorch's
#    FlashAttention 2 and with cuDNN's fused attention, beside the simulator's price by kind
#    (benchmarks/sustained_layer.py).
# HBM_BYTES_PER_S is the device's datasheet bandwidth: by default an H200's 4.8e12 where the
# device says it is one, else an H100 SXM's 3.35e12.
set -u
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: bash benchmarks/device_session.sh OUT_DIR [HBM_BYTES_PER_S]" >&2
    exit 2
fi
out="$(mkdir -p "$1" 2>/dev/null && cd "$1" && pwd)" || { echo "error: cannot write the output folder $1" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 2
name="$(python -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")')"
if [ -z "$name" ]; then
    echo "error: benchmarks/device_session.sh needs a CUDA GPU, and torch sees none here" >&2
    exit 2
fi
case "$name" in *H200*) default_hbm=4.8e12 ;; *) default_hbm=3.35e12 ;; esac
hbm="${2:-$default_hbm}"
echo "$name, datasheet HBM $hbm B/s" | tee "$out/device.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv >> "$out/device.txt" 2>&1

step() {  # a name, a time limit in seconds, then the command; its output kept beside its results
    local label="$1" limit="$2"
    shift 2
    echo "== $label (at most $limit s)"
    timeout "$limit" "$@" > "$out/$label.log" 2>&1
    echo "   exit $?; $(tail -n 1 "$out/$label.log")"
}

step memory_kernels 120 python benchmarks/measure_memory_kernels.py --out "$out/memory_kernels.json"
[ -s "$out/memory_kernels.json" ] && step memory_rates 30 \
    python benchmarks/memory_kernel_rates.py "$out/memory_kernels.json" --hbm "$hbm" --out "$out/memory_rates.json"
step calibrate 120 python benchmarks/calibrate_gpu.py --hbm "$hbm" --out "$out/calibration.json"
step sustained 120 python benchmarks/sustained_load.py --out "$out/sustained.json"
step blocks_flash 70 python benchmarks/sustained_layer.py --seconds 10 --out "$out/blocks_flash.json"
step blocks_cudnn 70 python benchmarks/sustained_layer.py --seconds 10 --attention cudnn --out "$out/blocks_cudnn.json"
