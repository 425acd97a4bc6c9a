#!/usr/bin/env bash
# The GPU paths CI cannot run, as one short script for a lent GPU machine (or any CUDA box):
#   1. bench/collectives.py under NCCL (every op, 8 B .. 1 GiB, checked values);
#   2. CUDA training: the demo on one node with trainer.backend = nccl, under DDP, FSDP2, and
#      DDP with bf16 compute; then the hf engine on a tiny local Llama on the GPU;
#   3. what came after the first run: the tiny Llama under FSDP2 with bf16 compute (hfbf16), the
#      multi-turn agent demo (agent), and async RL with a rollout-only worker whose engine runs on
#      the GPU and takes the weights the trainer publishes (async);
#   4. the unit tests on a host where CUDA is present (CI has none): a file whose optional package
#      is missing there (datasets, shellcheck, kubernetes-validate) fails, and the rest runs;
#   5. a mid-sized random Llama (hfmid: 16 layers of width MID_WIDTH, default 1024, ~240M
#      parameters) under FSDP2 with bf16 compute in micro-batches of 16 rows, its GPU memory
#      sampled every 0.5 s;
#   6. the hf engine's sleep and update against module.to (bench/engine_sleep.py, engine);
#   7. the control-plane benches of issue 18 (streams, barriers) on this machine's cores.
# Each step has its own time limit and writes its log and JSON under OUT (default: ./gpu-check),
# so a step that fails or runs out of time leaves the others' results. Usage:
#   bash tools/gpu_check.sh [steps]     # comma-separated from env,coll,train,hf,hfbf16,agent,async,units,hfmid,engine,stream,barrier
# Without a GPU it runs the same steps with gloo on the CPU (a dry run of the script itself).
# Wheels in .whl/ (grpcio, protobuf, ... for a machine with no package index) are installed first.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-check}
STEPS=${1:-env,coll,train,hf,hfbf16,agent,async,units,hfmid,engine,stream,barrier}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

WHEELS=${WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The package itself, for the torchrun handler entry point (--rdzv-backend=elasticrl).
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || echo "editable install failed (see install.log); torchrun falls back to c10d" >&2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    BACKEND=nccl
else
    BACKEND=gloo
fi
echo "backend: $BACKEND"

step() {  # step NAME LIMIT_S COMMAND...: run COMMAND under a time limit, log to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "step $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}

step env 60 bash -c "nvidia-smi -L; $PY -c 'import torch, grpc, google.protobuf as pb; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version() if torch.cuda.is_available() else None, \"grpc\", grpc.__version__, \"protobuf\", pb.__version__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no cuda\")'; nproc"

# One GPU: world size 1 (NCCL refuses two ranks on one device), so this checks the NCCL path,
# the CUDA timing and the value checks, not a fabric.
step coll 120 $PY -m torch.distributed.run --standalone --nproc-per-node=1 bench/collectives.py \
    --backend "$BACKEND" --op all -b 8 -e 1G -f 8 -n 10 -w 3 --json "$OUT/coll.json"

train() {  # train TAG OVERRIDES...: the demo's GRPO run on one node with this backend
    local tag=$1
    shift
    $PY -m elasticrl.cli run --nodes 1 --iterations 12 --timeout 240 --out "$OUT/run-$tag" \
        -- --trainer.backend="$BACKEND" --run.eval_interval=6 --checkpoint.every_iterations=6 "$@"
}
gpu_only() { [ "$BACKEND" = nccl ] && echo "$@"; }
step train 300 bash -c "set -e; $(declare -f train); BACKEND=$BACKEND PY=$PY OUT=$OUT; \
    train ddp; train fsdp2 --trainer.strategy=fsdp2; $(gpu_only train ddp-bf16 --trainer.bf16=true)"

step hf 240 bash -c "set -e; $(declare -f train); BACKEND=$BACKEND PY=$PY OUT=$OUT; \
    $PY -c 'import sys; from elasticrl.rollout.tiny_llama import write_tiny_llama; write_tiny_llama(sys.argv[1], hidden_size=64, num_attention_heads=2, num_key_value_heads=1)' $OUT/tiny-llama; \
    $PY -m elasticrl.cli run --config examples/configs/hf-cpu.toml --nodes 1 --iterations 6 --timeout 200 --out $OUT/run-hf \
        -- --model.path=$OUT/tiny-llama --trainer.backend=$BACKEND --run.eval_interval=3 --checkpoint.every_iterations=3 \
        --logging.tensorboard=false --checkpoint.export_hf="

# bf16 compute needs a GPU; on a CPU dry run the step trains in fp32.
step hfbf16 240 bash -c "set -e; \
    test -d $OUT/tiny-llama || $PY -c 'import sys; from elasticrl.rollout.tiny_llama import write_tiny_llama; write_tiny_llama(sys.argv[1], hidden_size=64, num_attention_heads=2, num_key_value_heads=1)' $OUT/tiny-llama; \
    $PY -m elasticrl.cli run --config examples/configs/hf-cpu.toml --nodes 1 --iterations 4 --timeout 200 --out $OUT/run-hfbf16 \
        -- --model.path=$OUT/tiny-llama --trainer.backend=$BACKEND --trainer.strategy=fsdp2 $(gpu_only --trainer.bf16=true) \
        --logging.tensorboard=false --checkpoint.every_iterations=2 --checkpoint.export_hf=hf-export"

step agent 200 $PY -m elasticrl.cli run --config examples/configs/agent-demo.toml --nodes 1 --iterations 8 --timeout 180 \
    --out "$OUT/run-agent" -- --trainer.backend="$BACKEND" --run.eval_interval=4

# The worker's engine on the GPU (engine.device), fed by the trainer's published weights. Unquoted:
# on a CPU dry run gpu_only says nothing, and no argument at all is passed.
# shellcheck disable=SC2046
step async 240 $PY -m elasticrl.cli run --nodes 1 --rollout-workers 1 --iterations 8 --timeout 200 --out "$OUT/run-async" \
    -- --trainer.backend="$BACKEND" --rollout.max_staleness=1 $(gpu_only --engine.device=cuda:0)

step units 240 $PY -m pytest tests/unit -q -n 8 -p no:cacheprovider --continue-on-collection-errors

MID_WIDTH=${MID_WIDTH:-1024}
step hfmid 300 bash -c "set -e; \
    $PY -c 'import sys; from elasticrl.rollout.tiny_llama import write_tiny_llama; w = int(sys.argv[2]); write_tiny_llama(sys.argv[1], hidden_size=w, intermediate_size=4 * w, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, initializer_range=0.02)' $OUT/mid-llama $MID_WIDTH; \
    (while sleep 0.5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null || exit; done > $OUT/hfmid-gpu-mib.txt) & \
    trap 'kill %1 2>/dev/null || true' EXIT; \
    $PY -m elasticrl.cli run --config examples/configs/hf-cpu.toml --nodes 1 --iterations 5 --timeout 260 --out $OUT/run-hfmid \
        -- --model.path=$OUT/mid-llama --trainer.backend=$BACKEND --trainer.strategy=fsdp2 $(gpu_only --trainer.bf16=true) \
        --trainer.micro_batch_rows=16 --run.eval_interval=0 --logging.tensorboard=false --checkpoint.every_iterations=0 --checkpoint.export_hf="

# The hf engine's sleep and weight update (pinned host buffers, unfilled wake) against module.to.
step engine 180 $PY bench/engine_sleep.py --width "$MID_WIDTH" --json-out "$OUT/engine.json"

step stream 240 $PY bench/scheduler.py --sections stream --stream-repeats 10 --json-out "$OUT/stream.json"

step barrier 240 $PY bench/coordinator.py --members 64,512 --transports session,batched --modes memory,durable \
    --patterns burst --skip-failure --baselines tcpstore,rawgrpc --json-out "$OUT/barrier.json"

cat "$OUT/summary.txt"
