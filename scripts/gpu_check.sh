#!/usr/bin/env bash
# The GPU checks (issues 19, 27: the fast path; the canary and pin on the device; 42: the input pipeline) in one run
# (about 8-10 minutes on one GPU): the tests marked gpu, then the
# throughput benchmark on the GPU (resnet50 and vit_b_16, random weights, bf16, batch 256, the shipped
# ImageNet sample images from disk as an ImageFolder view; disteval's loop against a bare loop on batches already
# on the GPU, the same bare loop reading the same files through a plain DataLoader ("loader": disteval's fair
# baseline, both decode JPEGs on the host), a torchmetrics loop and a gather-per-batch loop), printed as one
# table at the end. Installs nothing beyond README's set-up.
#
#   bash scripts/gpu_check.sh [SHARED_DATA_DIR]     (default: ../shared/data beside this checkout)
#
# Writes its logs and JSON lines to ${OUT:-gpu_check_out}/. Exit 1 if a test or a benchmark check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DATA="${1:-../shared/data}"
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0

echo "== tests marked gpu"
timeout 240 python -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== throughput on the GPU"
VAL="$(mktemp -d)/val"   # ImageFolder view of the flat sample folder: symlinks, nothing copied
python scripts/imagenet_sample_tree.py "$VAL" --sample "$DATA/imagenet-sample-224" || status=1
# resnet50 also with 12 loader workers: where JPEG decoding on the host sets the pace, more workers move it
for run in resnet50:4 vit_b_16:4 resnet50:12; do
  model="${run%:*}" workers="${run#*:}"
  timeout 200 python benchmarks/throughput.py --device cuda --dtype bf16 --model "$model" --data-root "$VAL" \
      --batch-size 256 --world-sizes 1 --rounds 1 --repeats 5 --threads 4 --num-workers "$workers" \
      --methods bare loader disteval torchmetrics gather > "$OUT/throughput_${model}_w$workers.txt" 2>&1
  [ $? -eq 0 ] || status=1
  tail -4 "$OUT/throughput_${model}_w$workers.txt"
done

echo "== JPEG decoding on the host vs on the GPU (resnet50, bf16, 4 loader workers)"
for dec in false true; do
  timeout 150 python -m disteval hydra.run.dir="$OUT/decode_$dec" +experiment=imagenet_vit model.name=resnet50 \
      model.weights=null data.root="$VAL" data.batch_size=256 data.num_workers=4 precision=bf16 \
      dist.world_size=1 eval.progress=false data.decode_on_device=$dec > "$OUT/decode_$dec.txt" 2>&1 || status=1
  python -c "import json,sys; r=json.load(open(sys.argv[1])); print('decode_on_device=$dec', r['throughput'])" \
      "$OUT/decode_$dec/results.json" 2>/dev/null | tee -a "$OUT/decode.txt"
done

echo "== input pipeline on an ImageNet-val-like tree (issue 42): pixel cache, device decode, loader scaling"
TREE="$(mktemp -d)/inet-like"
python scripts/make_imagenet_like.py "$TREE" --n 5120 --sample "$DATA/imagenet-sample-224" || status=1
for model in resnet50 vit_b_16; do
  timeout 150 python benchmarks/throughput.py --device cuda --dtype bf16 --model "$model" --data-root "$TREE" \
      --batch-size 256 --world-sizes 1 --rounds 1 --repeats 3 --threads 4 --num-workers 4 --methods bare \
      > "$OUT/bare_$model.txt" 2>&1 || status=1
  # the first cache run builds the cache as it evaluates, the second reads it; then nvJPEG decode on the device
  for feed in cache_build:data.cache=pixels cache_read:data.cache=pixels device:data.decode_on_device=true; do
    name="${feed%%:*}" arg="${feed#*:}"
    timeout 200 python -m disteval hydra.run.dir="$OUT/pipe_${model}_$name" +experiment=imagenet_vit model.name="$model" \
        model.weights=null data.root="$TREE" data.batch_size=256 data.num_workers=12 precision=bf16 dist.world_size=1 \
        eval.progress=false data.cache_dir="$OUT/pixel_cache" "$arg" > "$OUT/pipe_${model}_$name.txt" 2>&1 || status=1
  done
done
for workers in 4 8 12; do  # loader scaling: PIL decode in the workers, resnet50
  timeout 200 python -m disteval hydra.run.dir="$OUT/scale_w$workers" +experiment=imagenet_vit model.name=resnet50 \
      model.weights=null data.root="$TREE" data.batch_size=256 data.num_workers=$workers precision=bf16 \
      dist.world_size=1 eval.progress=false > "$OUT/scale_w$workers.txt" 2>&1 || status=1
done
python - "$OUT" <<'PY' | tee "$OUT/pipeline.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def res(name):
    try:
        return json.loads((out / name / "results.json").read_text())
    except (OSError, ValueError):
        return None
for model in ("resnet50", "vit_b_16"):
    bare = None
    lines = [l for l in (out / f"bare_{model}.txt").read_text().splitlines() if l.startswith("{")] if (out / f"bare_{model}.txt").exists() else []
    if lines:
        bare = json.loads(lines[-1])["throughput"]["1"]["bare"]["images_per_s"]
    for name in ("cache_build", "cache_read", "device"):
        r = res(f"pipe_{model}_{name}")
        if r is None:
            print(f"{model} {name}: failed (see {out}/pipe_{model}_{name}.txt)")
            continue
        ips, p = r["throughput"]["images_per_s"], r.get("pipeline") or {}
        print(f"{model} {name}: loop {ips:,.0f} images/s, delivered {p.get('delivered_images_per_s') or 0:,.0f}, "
              f"{p.get('bound')}-bound; bare forward {bare or 0:,.0f} -> {ips / bare if bare else 0:.2f}x (target >= 0.7x)")
for workers in (4, 8, 12):
    r = res(f"scale_w{workers}")
    p = (r or {}).get("pipeline") or {}
    print(f"loader scaling, resnet50, {workers} workers: delivered {p.get('delivered_images_per_s') or 0:,.0f} images/s, "
          f"per worker {(p.get('loader') or {}).get('images_per_s_per_worker') or 0:,.0f}, {p.get('bound')}-bound")
PY

python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from rich.console import Console
from rich.table import Table
out = Path(sys.argv[1])
table = Table(title="disteval GPU check: " + (out / "gpu.txt").read_text().strip())
for col in ("model", "loader workers", "W", "method", "images/s", "x bare", "x loader"):
    table.add_column(col, justify="left" if col in ("model", "method") else "right")
for f in sorted(out.glob("throughput_*.txt")):
    lines = [l for l in f.read_text().splitlines() if l.startswith("{")]
    if not lines:
        table.add_row(f.stem.split("_", 1)[1], "-", "-", "failed (see log)", "-", "-", "-")
        continue
    s = json.loads(lines[-1])
    for w, methods in s["throughput"].items():
        loader = methods.get("loader", {}).get("images_per_s")
        for m, r in methods.items():
            table.add_row(s["config"]["model"], f.stem.rsplit("_w", 1)[-1], w, m, f"{r['images_per_s']:,.0f}", f"{r['x_bare']:.3f}x",
                          f"{r['images_per_s'] / loader:.3f}x" if loader else "-")
tests = (out / "tests.txt").read_text().strip().splitlines()
decode = (out / "decode.txt").read_text().strip() if (out / "decode.txt").exists() else "decode: no output"
pipeline = (out / "pipeline.txt").read_text().strip() if (out / "pipeline.txt").exists() else "pipeline: no output"
table.caption = "tests: " + (tests[-1] if tests else "no output") + "\n" + decode + "\n" + pipeline
Console(width=120).print(table)
PY
exit $status
