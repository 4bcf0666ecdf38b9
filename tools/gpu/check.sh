#!/usr/bin/env bash
# The one command a GPU session runs first (see docs/backends.rst, "Checking on a GPU"):
# on a fresh GPU machine with no network, in the repository root,
#
#   bash tools/gpu/check.sh            # everything; its steps' limits add up to 8 minutes
#   bash tools/gpu/check.sh --quick    # two lengths, fewer repeats
#
# 1. installs the wheels carried in .whl/ (tools/gpu/wheels.sh fetches them on a machine
#    with pip and network: a NumPy its numba-cuda can import), into /tmp/site, ahead of the image's own packages;
# 2. prints the GPU, the driver and the versions that matter;
# 3. runs tools/gpu/check.py: correctness of every dtype's flash kernels, the
#    tensor-core forward's rows at L = 4096 (d = 64 and 128, B = 1 and 4, H = 16,
#    causal or not), then timings of float32, float16 and bfloat16, forward and
#    forward + backward, at L = 1024..8192 against PyTorch, with a figure;
# 4. runs tools/gpu/check.py --backward: the tensor-core backward (opt-in until this
#    checks it) against the float64 reference, then timed at the same rows;
# 5. runs tools/gpu/check.py --tf32: float32 forward and backward as TF32 (opt-in)
#    against the float64 reference, then timed against PyTorch with TF32 off and on;
# 6. runs the CUDA tests on the GPU (not the simulator);
# 7. runs `tfmath bench attention --backend cuda` (float32, against PyTorch).
# The measurements come first, so that a lease cut short still brings them back.
#
# Every output lands in $OUT (the device tool's folder that comes back) or ./gpu_check;
# each step has its own time limit, so one that hangs cannot eat the others' time.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu_check}"
mkdir -p "$OUT"
QUICK="${1:-}"
export PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0 TFMATH_CUDA_TENSOR_CORES=1
export TFMATH_CUDA_TENSOR_CORE_BACKWARD=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "could not install .whl/"; exit 1; }
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
        --format=csv 2>&1
    "$PYTHON" - <<'EOF'
import importlib.metadata as m
for name in ("numba", "numba-cuda", "cuda-bindings", "torch", "numpy", "ml_dtypes"):
    try:
        print(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name} MISSING")
import tfmath
print("tfmath", tfmath.__version__, "from", tfmath.__file__)
print("cuda backend:", tfmath.backends()["cuda"])
EOF
} 2>&1 | tee "$OUT/versions.txt"

echo "== correctness and timings, float32, float16, bfloat16"
# 210 s (it had 240): each kernel now compiles and links its own C++ entry points only.
timeout 210 "$PYTHON" tools/gpu/check.py --out "$OUT" $QUICK 2>&1 | tee "$OUT/gpu_check.txt" \
    | tail -30
echo "gpu_check: exit ${PIPESTATUS[0]}"

echo "== the tensor-core backward: checks, then the issue's rows"
timeout 90 "$PYTHON" tools/gpu/check.py --backward --out "$OUT" $QUICK 2>&1 \
    | tee "$OUT/backward.txt" | tail -25
echo "backward: exit ${PIPESTATUS[0]}"

echo "== TF32: checks, then L = 4096 against PyTorch"
timeout 40 "$PYTHON" tools/gpu/check.py --tf32 --out "$OUT" $QUICK 2>&1 \
    | tee "$OUT/tf32.txt" | tail -15
echo "tf32: exit ${PIPESTATUS[0]}"

# Each new shape compiles its kernels, so the limit may cut the hypothesis tests short;
# step 3 checks random inputs too.
echo "== CUDA tests on the GPU"
timeout 105 "$PYTHON" -m pytest -q -m cuda \
    -p no:cacheprovider tests/test_cuda_device_path.py tests/test_cuda_flash.py \
    tests/test_attention.py \
    tests/test_half_precision.py 2>&1 | tee "$OUT/tests.txt" | tail -15
echo "tests: exit ${PIPESTATUS[0]}"

echo "== tfmath bench attention --backend cuda (float32)"
timeout 35 "$PYTHON" -m tfmath bench attention --backend cuda --quick 2>&1 \
    | tee "$OUT/bench_attention.txt" | tail -25
echo "bench: exit ${PIPESTATUS[0]}"

