#!/bin/bash
# Trains every diffusion backbone briefly on Fashion-MNIST (images) or Moving Fashion-MNIST (video), then
# samples and (images) evaluates each run: the commands behind docs/backbones.md's "first measured run"
# table. About 40 minutes on a 2-core CPU. The unet_3d run inflates the demo's run (scripts/demo first).
# Usage: examples/backbone_tour.sh [RUNS_DIR]   (default runs/tour); summary in RUNS_DIR/summary.txt
set -u
cd "$(dirname "$0")/.."
D=build/dew
R=${1:-runs/tour}
mkdir -p $R
common="--trainer.checkpoint_every 600 --trainer.log_every 100 --trainer.time_limit_minutes 6 --objective.steps 20"
dit='"patch_size":4,"emb_features":128,"num_layers":4,"num_heads":4'
text="--text_encoder.architecture byte_text_encoder --text_encoder.fields {\"features\":64,\"num_layers\":2,\"num_heads\":4,\"max_length\":32}"
img() {  # name arch fields extra...
  local name=$1 arch=$2 fields=$3; shift 3
  local t0=$(date +%s)
  $D train diffusion --run $R/$name --model.architecture $arch --model.fields "$fields" --trainer.steps 600 \
     --optim.lr 1e-3 $common "$@" > $R/$name.train.log 2>&1
  local t1=$(date +%s)
  $D eval $R/$name --solvers euler --steps 20 --guidance 3 --count 200 > $R/$name.eval.log 2>&1
  $D sample $R/$name --steps 20 --count 20 --out $R/$name.png > /dev/null 2>&1
  echo "$name train_s=$((t1-t0)) $(grep -c . $R/$name/metrics.jsonl) $(tail -1 $R/$name.eval.log)" >> $R/summary.txt
}
# the demo's unet at the same 600 steps (its own recipe: lr 2e-3)
$D train diffusion --run $R/unet --trainer.steps 600 $common > $R/unet.train.log 2>&1
$D eval $R/unet --solvers euler --steps 20 --guidance 3 --count 200 > $R/unet.eval.log 2>&1
echo "unet $(tail -1 $R/unet.eval.log)" >> $R/summary.txt
img simple_dit simple_dit "{$dit}"
img simple_udit simple_udit "{$dit}"
img uvit uvit "{$dit,\"image_size\":28}"
img hybrid_dit hybrid_dit "{$dit,\"ssm_state_dim\":64}"
img simple_mmdit simple_mmdit "{$dit}" $text
img hierarchical_mmdit hierarchical_mmdit '{"base_patch_size":2,"emb_features":[64,128],"num_layers":[2,4],"num_heads":[2,4]}' $text
vid() {
  local name=$1 arch=$2 fields=$3; shift 3
  local t0=$(date +%s)
  $D train diffusion --run $R/$name --model.architecture $arch --model.fields "$fields" --trainer.steps 300 \
     --optim.lr 1e-3 --loader.batch_size 8 --objective.preview_per_class 1 \
     --data '{"name":"moving_fashion_mnist","frames":8,"size":32}' $common "$@" > $R/$name.train.log 2>&1
  local t1=$(date +%s)
  $D sample $R/$name --steps 20 --labels 0,1,7,8,9 --count 5 --out $R/$name.png > $R/$name.sample.log 2>&1
  echo "$name train_s=$((t1-t0))" >> $R/summary.txt
}
vid video_dit video_dit "{$dit}"
vid unet_3d unet_3d '{"emb_features":64,"feature_depths":[32,64],"attention_configs":[null,null],"num_res_blocks":1,"num_middle_res_blocks":1,"norm_groups":8,"temporal_heads":4}' --init_from runs/fashion_mnist
echo done >> $R/summary.txt
