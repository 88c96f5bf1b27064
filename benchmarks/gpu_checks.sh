#!/usr/bin/env bash
# plait's checks on one GPU, in one command of about 6 minutes on an H100:
#
#   PYTHONPATH=src bash benchmarks/gpu_checks.sh          # from the repository root
#
# Each check runs under its own timeout, writes $OUT/<name>.log and the run goes on after
# a failure; the last lines are one PASS/FAIL line per check, also in $OUT/summary.txt.
# $OUT (default /tmp/plait-gpu-checks) ends up holding at most 8 files by default: env.log,
# pytest.log, peaks.log, profile.log, calibrate.log, calibrated.yaml, single_gpu.log,
# summary.txt (fsdp and rank add their logs: pick fewer checks with CHECKS=).
#
#   env         nvidia-smi, torch / CUDA versions, plait importing without torchao,
#               datasets and peft (blocked; the GPU machine has none of them)    ~15 s
#   pytest      tests/test_cuda.py (the CUDA paths) and tests/test_context.py    ~90 s
#   peaks       plait rehearse, plait simulate and 3 steps of plait train of a ~1B
#               llama (bf16, seq 2048, micro-batch 4, 2 micro-batches): the
#               rehearsed, simulated and measured peak memory and step time      ~100 s
#   profile     benchmarks/gpu_profile.py: GPT-2 124M and the ~1B llama, 4 steps each,
#               steps 3-4 under plait train --profile: device time by kind of kernel
#               against the performance model's split, and the GPU's idle time        ~80 s
#   calibrate   plait calibrate --device cuda --quick --dtypes fp32,bf16 (one GPU:
#               compute and model-step probes, no collectives)                   ~45 s
#   single_gpu  benchmarks/single_gpu.py, one round, measured vs simulated on
#               the calibrated file (eager and compiled: compile time counts)    ~120 s
#   rank        (only when CHECKS names it) benchmarks/rank_on_gpu.py --only 7b-z3 --kernels 30
#               --profile: rank 0 of llama2-7b dp 64 ZeRO-3 run for real under the
#               fake process group: CUDA's peak against the rehearsal's and the
#               model's, device time by kind against the model's                 ~110 s
#   fsdp        (only when CHECKS names it) benchmarks/fsdp_step.py: an MPT-shaped
#               step under FSDP1 as llm-foundry ran it, with and without
#               recomputation, by kind of kernel against the model's fsdp runtime ~120 s
#
# SMOKE=1 checks the script itself on a CPU machine: a tiny model in peaks, calibrate on
# the CPU, single_gpu.py --smoke (env and the CUDA tests fail or skip there).
#
# No network: the data is written here from Python's standard library and tokenised
# with the bytes tokenizer. Estimated times are guesses for an H100 (nothing here has run
# on a GPU before); the timeouts bound the whole at 500 s (a device command may run 600).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-src}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/plait-gpu-checks}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
WORK="$(mktemp -d /tmp/plait-gpu-work.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
export PLAIT_KEY_FILE="$WORK/key"  # plait train signs its checkpoint: a key of this run
SUMMARY=()

check() {  # check NAME SECONDS COMMAND...: run it, log to $OUT/NAME.log, note PASS/FAIL
    local name=$1 limit=$2 start rc status
    shift 2
    start=$(date +%s)
    echo "== $name (limit ${limit} s) ..."
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        status=PASS
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status="FAIL (timed out after ${limit} s)"
    else
        status="FAIL (exit $rc)"
    fi
    SUMMARY+=("$(printf '%-11s %-30s %4d s  %s' "$name" "$status" $(($(date +%s) - start)) "$name.log")")
    echo "   ${SUMMARY[-1]}"
    tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
}

env_check() {
    local failed=0
    nvidia-smi || failed=1
    "$PY" - <<'EOF' || failed=1
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| cudnn", torch.backends.cudnn.version())
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0),
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
from plait.train.metrics import gpu_peak
print("plait's bf16 peak for it:", gpu_peak(torch.cuda.get_device_name(0), "bf16"), "TFLOP/s")
EOF
    # plait (every module) imports with torchao, datasets and peft blocked
    mkdir -p "$WORK/block"
    cat >"$WORK/block/sitecustomize.py" <<'EOF'
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchao", "datasets", "peft"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")

sys.meta_path.insert(0, _Block())
EOF
    PYTHONPATH="$WORK/block:$PYTHONPATH" "$PY" - <<'EOF'
import importlib, pkgutil, sys
import plait, plait.cli
bad = []
for m in pkgutil.walk_packages(plait.__path__, "plait."):
    try:
        importlib.import_module(m.name)
    except Exception as e:  # noqa: BLE001
        bad.append(f"{m.name}: {e!r}")
print("import plait.cli: ok;", "modules failing to import:", bad or "none")
sys.exit(1 if bad else 0)
EOF
    [ $? -eq 0 ] && [ $failed -eq 0 ]
}

corpus() {  # ~4 MB of the standard library's Python, one text file
    "$PY" - "$WORK/corpus.txt" <<'EOF'
import pathlib, sys, sysconfig
root = pathlib.Path(sysconfig.get_paths()["stdlib"])
parts, size = [], 0
for p in sorted(root.glob("*.py")):
    text = p.read_text(errors="replace")
    parts.append(text)
    size += len(text)
    if size > 4_000_000:
        break
pathlib.Path(sys.argv[1]).write_text("\n".join(parts))
print(f"corpus: {size / 1e6:.1f} MB from {len(parts)} files")
EOF
}

peaks() {
    local gpu=h100-sxm
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H200*) gpu=h200 ;; esac
    corpus || return 1
    # one GPU, a ~1B llama (vocabulary 256: the bytes tokenizer's), bf16, seq 2048
    local model=(--model llama3.2-1b --vocab-size 256 --seq-len 2048 --micro-batch-size 4
                 --global-batch-size 8 --dtype bf16)
    [ -n "${SMOKE:-}" ] && model=(--model tiny --arch llama --vocab-size 256 --seq-len 128
                                  --micro-batch-size 2 --global-batch-size 4 --dtype bf16)
    echo "--- plait rehearse ($(date +%T))"
    "$PY" -m plait.cli rehearse "${model[@]}" --tokenizer bytes --ranks 0 --json \
        >"$WORK/rehearse.json" || return 1
    echo "--- plait simulate --gpu $gpu ($(date +%T))"
    "$PY" -m plait.cli simulate "${model[@]}" --gpu "$gpu" --gpus 1 --json \
        >"$WORK/simulate.json" || return 1
    echo "--- plait train (3 steps, then its final checkpoint) ($(date +%T))"
    # in the background: if it outlasts TRAIN_LIMIT, its workers' Python stacks go to their
    # logs (faulthandler on SIGABRT) and the tail of rank 0's is printed here
    PYTHONFAULTHANDLER=1 "$PY" -m plait.cli train "${model[@]}" --data "$WORK/corpus.txt" \
        --tokenizer bytes --cache-dir "$WORK/cache" --steps 3 --warmup 1 --eval-batches 1 \
        --no-progress --out "$WORK/run" &
    local pid=$! waited=0 rc
    while kill -0 $pid 2>/dev/null && [ $waited -lt "${TRAIN_LIMIT:-150}" ]; do
        sleep 1
        waited=$((waited + 1))
    done
    if kill -0 $pid 2>/dev/null; then
        echo "--- plait train still running after $waited s ($(date +%T)): rank 0's stacks"
        pkill -ABRT -f plait.train.worker
        sleep 3
        kill $pid 2>/dev/null
        sleep 2
        grep -v '^\s*$' "$WORK/run/logs/rank-0.log" | tail -n 40
        rc=124
    else
        wait $pid
        rc=$?
    fi
    echo "--- done ($(date +%T)), plait train exit $rc"
    ls -la "$WORK/run" "$WORK/run/checkpoints" 2>/dev/null | head -20
    "$PY" - "$WORK" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
GB = 1e9
reh = json.load(open(work / "rehearse.json"))["ranks"][0]
sim = json.load(open(work / "simulate.json"))
steps = [json.loads(x) for x in (work / "run/metrics.jsonl").read_text().splitlines()]
r0 = work / "run/ranks/rank-0.json"
rank0 = json.load(open(r0)) if r0.exists() else {"peak_mem_bytes": float("nan")}
phase = {p["name"]: p["peak"] for p in reh["phases"]}
print("phases rehearsed (peak GB):", {k: round(v / GB, 2) for k, v in phase.items()})
print("rehearsed split at its peak:", reh["simulated"]["memory"])
train_peak = max(phase[k] for k in phase if k.startswith("step"))
print(f"peak memory  rehearse (steps) {train_peak / GB:.2f} GB | simulate {sim['peak_mem_bytes'] / GB:.2f} GB"
      f" | measured torch.cuda.max_memory_allocated per step "
      + ", ".join(f"{r['peak_mem_bytes'] / GB:.2f}" for r in steps)
      + f" GB (whole run incl. checkpoint: {rank0['peak_mem_bytes'] / GB:.2f} GB)")
print(f"measured / rehearsed {steps[-1]['peak_mem_bytes'] / train_peak:.3f}, "
      f"measured / simulated {steps[-1]['peak_mem_bytes'] / sim['peak_mem_bytes']:.3f}")
ckpts = sorted((work / "run/checkpoints").glob("step-*"))
if ckpts:  # metrics.jsonl is written just before the final save, manifest.json last in it
    size = sum(f.stat().st_size for f in ckpts[-1].iterdir())
    took = (ckpts[-1] / "manifest.json").stat().st_mtime - (work / "run/metrics.jsonl").stat().st_mtime
    print(f"final checkpoint {size / GB:.2f} GB written, hashed and committed in {took:.1f} s "
          f"({size / GB / max(took, 1e-9):.2f} GB/s)")
print(f"step time    simulate ({sim['hardware']}) {sim['iter_time_s']:.3f} s | measured "
      + ", ".join(f"{r['step_time_s']:.3f}" for r in steps)
      + f" s (MFU {steps[-1]['mfu']:.1%}); losses " + ", ".join(f"{r['loss']:.3f}" for r in steps))
EOF
    return $rc
}

DEVICE=cuda
[ -n "${SMOKE:-}" ] && DEVICE=cpu
export PY WORK
export -f env_check corpus peaks  # timeout runs them in a child bash
# CHECKS picks some (a rerun): e.g. CHECKS="pytest peaks"; default all, in this order
CHECKS=" ${CHECKS:-env pytest peaks profile calibrate single_gpu} "
want() { [[ "$CHECKS" == *" $1 "* ]]; }
want env && check env 30 bash -c env_check
want pytest && check pytest 60 "$PY" -m pytest -q -s -p no:cacheprovider tests/test_cuda.py \
    ${CONTEXT_TESTS-tests/test_context.py}
want peaks && check peaks 220 bash -c peaks
want profile && check profile 150 "$PY" benchmarks/gpu_profile.py ${SMOKE:+--smoke}
want calibrate && check calibrate 90 "$PY" -m plait.cli calibrate --device "$DEVICE" \
    --quick --dtypes fp32,bf16 ${SMOKE:+--procs 1} --out "$OUT/calibrated.yaml"
HW=()
[ -s "${HARDWARE:-$OUT/calibrated.yaml}" ] && HW=(--hardware "${HARDWARE:-$OUT/calibrated.yaml}")
want fsdp && check fsdp 200 "$PY" benchmarks/fsdp_step.py ${SMOKE:+--smoke}
RANK=(--only 7b-z3)
[ -n "${SMOKE:-}" ] && RANK=(--smoke --only tiny-z3)
want rank && check rank 240 "$PY" benchmarks/rank_on_gpu.py --profile --kernels 30 "${RANK[@]}"
want single_gpu && check single_gpu 150 "$PY" benchmarks/single_gpu.py --rounds 1 --steps 8 \
    --warmup-steps 3 ${SMOKE:+--smoke} "${HW[@]}"

printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
