#!/usr/bin/env bash
# Issue 32's check on a GPU, in one prepared run of at most 7 minutes (benchmarks/README.md, "On a GPU").
#
# From the repository root:
#   set -o pipefail; bash benchmarks/gpu_check.sh 2>&1 | tee "$OUT/log"
# Environment:
#   OUT     where the results go (default runs/gpu_check): the JSON of each benchmark
#   DEVICE  cuda (default), or cpu for a rehearsal of the whole script
#   QUICK=1 tiny sizes and few rounds: a smoke test of the script, not a measurement
#   PYTHON  the interpreter (default python3)
# Missing packages travel as wheels in .whl/ (backpack-for-pytorch, cockpit-for-pytorch and
# what they need that the GPU machine lacks); they are installed into /tmp/site.
#
# Parts, each under its own time limit so that a part that hangs costs only its own:
#   (a) exactness on the device: check_model on the benchmark's models in float64, and the
#       quantities against the tests' float64 references (CGN_TEST_DEVICE, tests/cases.py);
#   (b) tests/test_device_sync.py's CUDA test (no host-device synchronisation in a step);
#   (c) benchmark_realistic: GPT-2 small and a Llama of its size, wall-clock, peak memory,
#       the tiny configurations' overhead per module;
#   (d) benchmark.py on the GPT, resnet18, the mixture of experts and the Swin.
set -u -o pipefail
OUT=${OUT:-runs/gpu_check}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1  # nothing downloads there
mkdir -p "$OUT"
START=$SECONDS
SUMMARY=""

part() {  # part NAME SECONDS COMMAND...: run COMMAND within SECONDS, note its exit status
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo
    echo "=== $name (limit ${limit} s, at $((SECONDS - START)) s)"
    timeout -k 5 "$limit" "$@"
    rc=$?
    [ "$rc" = 124 ] && rc="124 (TIMED OUT)"
    echo "=== $name: exit $rc, $((SECONDS - start)) s"
    SUMMARY+="$(printf '%-28s exit %s, %s s' "$name" "$rc" "$((SECONDS - start))")"$'\n'
}

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "installing the wheels failed"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's cockpit_gradnoise first

echo "=== versions ($(date -u +%FT%TZ), DEVICE=$DEVICE QUICK=$QUICK)"
git log -1 --format='commit %H %s' 2>/dev/null || echo "commit: not a git checkout"
"$PYTHON" - <<'EOF'
import importlib.metadata as metadata, platform
import torch
import cockpit_gradnoise
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "| TF32 matmul", torch.backends.cuda.matmul.allow_tf32)
for name in ("backpack-for-pytorch", "cockpit-for-pytorch", "transformers", "timm", "torchvision",
             "numpy", "pandas", "opt_einsum", "unfoldNd", "json_tricks"):
    try:
        print(f"  {name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"  {name} NOT INSTALLED")
print("cockpit_gradnoise from", cockpit_gradnoise.__file__)
EOF
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv

if [ "$QUICK" = 1 ]; then
    CHECK_MODELS=gpt; TESTS_K="reference and [gpt-N7-mean]"
    REALISTIC=(--quick --tiny-rounds 3); BENCH=(--quick)
    LIMITS=(900 900 900 900 900)  # a rehearsal on a loaded CPU: limits that only catch a hang
else
    CHECK_MODELS=gpt,resnet18,moe,swin
    TESTS_K="reference and ([gpt-N7-mean] or hf-gpt2-tied-N7-mean or hf-llama-N8-mean or resnet18-N3-mean)"
    REALISTIC=(--rounds 10 --warmup 2 --tiny-rounds 30); BENCH=(--rounds 15 --warmup 2)
    # Seconds for (a) check_model, (a) the quantities, (b), (c) each model, (d) each model:
    # 35 + 75 + 30 + 2 x 65 + 4 x 30 = 390 s, with the install, versions and kill grace under 7 min.
    # (On a loaded 2-core CPU the 16 tests take 39 s of CPU time, resnet18's quantiles the most.)
    LIMITS=(35 75 30 65 30)
fi

part "(a) check_model, float64" "${LIMITS[0]}" "$PYTHON" -m benchmarks.check_device --device "$DEVICE" \
    --models "$CHECK_MODELS"
part "(a) quantities, float64" "${LIMITS[1]}" env CGN_TEST_DEVICE="$DEVICE" "$PYTHON" -m pytest -v -rfEs \
    -p no:cacheprovider tests/test_core_quantities.py tests/test_gradient_noise_scale.py \
    tests/test_param_grad_ratio.py -k "$TESTS_K"
part "(b) no synchronisation" "${LIMITS[2]}" "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider \
    tests/test_device_sync.py -k cuda
for model in gpt2 llama; do
    part "(c) realistic $model" "${LIMITS[3]}" "$PYTHON" -m benchmarks.benchmark_realistic --device "$DEVICE" \
        --models "$model" --threads 4 --json "$OUT/realistic-$model.json" "${REALISTIC[@]}"
done
for model in gpt resnet18 moe swin; do
    part "(d) benchmark.py $model" "${LIMITS[4]}" "$PYTHON" benchmarks/benchmark.py --device "$DEVICE" \
        --models "$model" --threads 4 --json "$OUT/bench-$model.json" "${BENCH[@]}" \
        --methods "empty Cockpit,PerExampleGradNorm,GradientNoiseScale,package: all together"
done

echo
echo "=== summary ($((SECONDS - START)) s in all)"
printf '%s' "$SUMMARY"
