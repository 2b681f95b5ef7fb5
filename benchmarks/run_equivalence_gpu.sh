#!/usr/bin/env bash
# The bf16 GPU equivalence checks on one GPU (an H200: about 6 minutes), under the primary criterion of
# benchmarks/criterion.py, everything written to $OUT (five files):
#   gpu_equivalence_hd128.md/.json   every gpu_equivalence.py run below at head dim 128, a section / key each:
#     paths                  SDPA default/flash/cuDNN/memory-efficient and flex_attention, padded and packed waves,
#                            the split-attention kernels alone, the padded-batch control
#     checkpointing, offload, checkpointing_offload     cuDNN and flash, padded
#     variants               cuDNN, padded: the three broken variants (each must fail) and concat-attention (must pass)
#   gpu_moe_trajectory.md/.json      Qwen3-MoE under routing replay, 20 SGD steps, checked at steps 1, 10 and 20
#   run_equivalence_gpu.log          all output
# Needs torch and transformers only. Run from anywhere:  OUT=/some/folder bash benchmarks/run_equivalence_gpu.sh
# Each run has a time limit (500 s in all, so the whole script ends within a 10-minute command) and writes its
# results after every case, merged into $OUT after every run: a run cut short keeps what finished. Exits with 1
# unless every correct and diagnostic row passed and every broken row failed.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT"
exec > >(tee "$OUT/run_equivalence_gpu.log") 2>&1
parts=$(mktemp -d)
status=0
start=$SECONDS

run() {  # LIMIT_S NAME COMMAND...: one run, its exit status noted
  local limit=$1 name=$2
  shift 2
  echo "== [$((SECONDS - start)) s] $name: $*"
  timeout "$limit" "$@"
  local rc=$?
  echo "== [$((SECONDS - start)) s] $name: exit $rc$([ $rc = 124 ] && echo " (time limit ${limit} s)")"
  [ $rc = 0 ] || status=1
}

merge() {  # every gpu_equivalence run so far, one md and one json in $OUT
  python3 - "$parts" "$OUT" <<'PY'
import json, pathlib, sys
parts, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
tags = ["paths", "checkpointing", "offload", "checkpointing_offload", "variants"]
found = [t for t in tags if (parts / f"{t}.json").exists() and (parts / f"{t}.md").exists()]
(out / "gpu_equivalence_hd128.json").write_text(
    json.dumps({t: json.loads((parts / f"{t}.json").read_text()) for t in found}, indent=1))
(out / "gpu_equivalence_hd128.md").write_text("\n".join(f"<!-- {t} -->\n" + (parts / f"{t}.md").read_text()
                                                         for t in found))
PY
}

equivalence() {  # LIMIT_S TAG ARGS...: one gpu_equivalence.py run at head dim 128
  local limit=$1 tag=$2
  shift 2
  run "$limit" "$tag" python3 benchmarks/gpu_equivalence.py --head-dim 128 --steps 3 --out "$parts" --tag "$tag" "$@"
  merge
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
equivalence 210 paths
padded=(--paths sdpa-cudnn,sdpa-flash --no-kernel-check --no-control)
equivalence 45 checkpointing "${padded[@]}" --checkpointing
equivalence 45 offload "${padded[@]}" --offload
equivalence 50 checkpointing_offload "${padded[@]}" --checkpointing --offload
equivalence 60 variants --paths sdpa-cudnn --no-correct --broken phase-c-skipped,drop-layer-gk,split-own-stats \
  --diagnostic concat-attention --no-kernel-check --no-control
run 90 gpu_moe_trajectory python3 benchmarks/gpu_moe_trajectory.py --out "$OUT"
verdict=$([ $status = 0 ] && echo "every run as required" || echo "SOME RUN FAILED OR ERRED")
echo "== [$((SECONDS - start)) s] done: $verdict"
exit $status
