#!/usr/bin/env bash
# One device-machine session: environment facts, GPU correctness checks, benchmarks.
# Usage (on the GPU machine, repo root): bash scripts/device/gpu_session.sh [sections...]
# Sections:
#   env        GPU, clocks, topology, torch / Triton versions
#   kernels    tests/gpu kernel tests (grouped GEMMs, fp8_block kernels, routing; not the
#              CUTLASS units)
#   fp8kernels the fp8_block kernel tests alone (quantizers bit-exact, GEMMs vs their twins; FP8K:
#              a pytest -k expression to narrow them, e.g. "quantize or swiglu_bwd")
#   mxkernels  the mxfp8 kernel tests alone (every output bit-exact vs quant/mxfp8.py)
#   nvkernels  the nvfp4 kernel tests alone (byte rows bit-exact, the NVFP4 GEMMs vs their twin:
#              the Triton kernel and the CUDA GEMMs of csrc/nvfp4_decode_mm.cu, nvfp4_wgmma_mm.cu;
#              NVK: a pytest -k expression to narrow them, e.g. "dense_mm")
#   sm90       the CUTLASS units of csrc/ (bf16 FPROP / WGRAD, FP8 FPROP / WGRAD) vs their oracles
#              (SM90_K: a pytest -k expression, e.g. "fp8")
#   megakernel the Mega forward kernel against the standard two launches
#   fenceprobe the nvfp4 wgmma GEMM with its per-chunk proxy fence deleted (a copy of the tree in
#              /tmp/fenceprobe; its results are undefined, so timing only) against the real one:
#              ncu durations of W13 and W2 at 32 rows per expert. The fence (MEMBAR.ALL.CTA in
#              SASS) also waits for the register ring's weight loads; this bounds what removing it
#              (token copies through TMA) could gain
#   megatime   the Mega kernel and the two standard launches timed alone at the guide shape
#              (scripts/device/mega_once.py, alternated rounds, h1 stored and not), then ncu of
#              one launch of each where ncu exists (cycles at the same clocks)
#   check      dist_check on 1 GPU (and 2 when present): every gradient vs the fp64 oracle,
#              graph replay, no host sync, bitwise repeats, inference
#   packing    ten layers in one slot inside one CUDA graph
#   inference  inference at the guide's expert shapes, T = 1..4096, eager and graph, guarded arena,
#              every precision and pipeline the backend runs (INFERENCE_ARGS, e.g.
#              "--precisions nvfp4 --pipelines standard")
#   traps      the device traps that end a job with a message (1 GPU: overflow, bad id, layout)
#   layer      bench_layer (LAYER_ARGS, e.g. "--cases guide --paths dist_moe,a2a")
#   baseline   the same bench_layer run on the tree in $BASE_TREE (a copy of an older commit, e.g.
#              made by `git archive cfa8b72 | tar -x -C _base`), for a same-session comparison
#              (BASE_LAYER_ARGS instead of LAYER_ARGS where the old tree takes other arguments)
#   abtrees    bench_layer on this tree and on $BASE_TREE for ROUNDS rounds (default 4), the order
#              swapped every other round (LAYER_ARGS, BASE_LAYER_ARGS), then benchmarks/ab_trees.py:
#              each round's difference per path and mode and their median (a path both trees run
#              unchanged is the control)
#   bench      bench_grouped_gemm (BENCH_ARGS)
#   quant      bench_quant: the fp8_block / mxfp8 activation quantizers in TB/s against the copy
#              rate, bit-exact first (QUANT_ARGS, e.g. "--group-rows 0,1,4", "--tiles all" or
#              "--fp8-tiles all --kernels fp8_block:quantize_x,fp8_block:quantize_gh1,
#              fp8_block:quantize_h2_cols", without the line break)
#   quantbase  the same bench_quant run on the tree in $BASE_TREE (QUANT_BASE_ARGS instead of
#              QUANT_ARGS where the old tree takes other arguments)
#   fp8gemm    bench_fp8_gemm: the fp8_block kernels beside bf16 and torch._scaled_mm (FP8_ARGS)
#   nvfp4gemm  bench_nvfp4_gemm: the NVFP4 GEMM's decodes and tiles beside bf16 (NVFP4_ARGS,
#              e.g. "--sweep")
#   claimsweep claim-mode variants of the staged pipeline's GEMMs
#   ab         interleaved A/B in one process (AB_A, AB_B execution overrides; AB_ARGS)
#   sustained  one graph replayed back to back from idle: ms next to SM clock and power
#              (SUSTAINED_ARGS, e.g. "--workloads dist_moe_fwd,dist_moe_mega_fwd")
#   nvlink     peer row traffic alone and next to a GEMM (2 GPUs)
#   floor      the layer's six GEMMs alone (ours, torch's) next to the dense mm, settled
#   weights    the Megatron plugin's weight plumbing per layer call
#   packbench  bench_packing (PACK_ARGS)
#   routing    the routing-table kernels (one launch and two) against the torch tables
#   decode     bench_decode: the forward at T = 1..2048 next to its weight-read floor (DECODE_ARGS)
#   decodebase the same bench_decode run on the tree in $BASE_TREE (BASE_DECODE_ARGS instead of
#              DECODE_ARGS where the old tree takes other arguments)
#   megatron   tiny GPT, dist_moe vs alltoall (SEEDS, STEPS, MB, MOE_BACKEND, PERTURB,
#              MEGATRON_ARGS, e.g. "--fp8-recipe blockwise": fp8_block experts against the bf16
#              band, a bf16 dist_moe model beside them; ~8 min for 300 steps on one H100), then
#              each seed's benchmarks/megatron_loss_noise.py verdict
#   lmeval     examples/tiny_lm_nvfp4_eval.py on the CUDA backend: bf16 / fp8_block / mxfp8
#              training against the bf16 noise band (six perturbed repeats; then
#              benchmarks/lm_noise_band.py's verdicts), then the held-out loss with nvfp4 experts
#              (LMEVAL_SEEDS, e.g. "1234 7 11 23 42", default 1234; LMEVAL_ARGS)
#   targets    the open issues' target rows in one go, into $OUT/targets: bench_layer at the guide
#              load (bf16 standard, Mega, fp8_block with cached weights: issues 16 and 19),
#              bench_decode at T = 1..2048 (bf16 standard and Mega, nvfp4: issues 18 and 19),
#              bench_fp8_gemm (W13 FPROP: issue 16); ~2 min on one GPU
#   pack       fold everything under $OUT into one archive (the device tool brings back few files)
# GIT_COMMIT: the commit of the tree that travels (the device copy's git HEAD is the last
# landed commit, not the working tree's), written into every CSV row; pass it in the command.
# Knobs: FP8K NVK CHECK_ARGS PACKING_ARGS LAYER_ARGS PACK_ARGS BENCH_ARGS FP8_ARGS QUANT_ARGS DECODE_ARGS
# QUANT_BASE_ARGS BASE_LAYER_ARGS BASE_DECODE_ARGS (extra arguments), BASE_TREE BASE_COMMIT (the baseline tree and
# its commit), TMO (seconds per step).
# megatron-core travels as a wheel in .whl/ (carry it); it is installed into /tmp/site here.
# Logs go to $OUT (or ./out) so the device tool brings them back.
set -u
OUT=${OUT:-./out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
# the csrc/ CUTLASS library: a build made on the CPU machine can be carried in .csrc_cache (its
# key covers the sources, flags, nvcc version and CUTLASS version; a mismatch rebuilds here)
export DIST_MOE_CSRC_CACHE=${DIST_MOE_CSRC_CACHE:-$PWD/.csrc_cache}
# no CUTLASS wheel there: .csrc_cache/cutlass_min (cutlass/cutlass.h and version.h copied from the
# wheel here) lets the carried build's cache key resolve, so fp8_block's WGRADs run on CUTLASS
if [ -z "${DIST_MOE_CUTLASS_DIR:-}" ] && [ -d "$DIST_MOE_CSRC_CACHE/cutlass_min" ] \
   && ! python3 -c 'import importlib.util, sys; sys.exit(not importlib.util.find_spec("cutlass_library"))' 2>/dev/null; then
  export DIST_MOE_CUTLASS_DIR=$DIST_MOE_CSRC_CACHE/cutlass_min
fi
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
sections=${*:-env check}
# each step runs under a time limit: $TMO when set, else the step's LIMIT, else 420 s, so a hung
# step cannot eat the session's device time
run() { local name=$1; shift; local t0=$(date +%s)
  echo "=== $name: $*"; timeout "${TMO:-${LIMIT:-420}}" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n "${TAIL:-40}"
  echo "=== $name rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 ))s"; }
for s in $sections; do case $s in
  env) nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
       nvidia-smi topo -m | head -5
       python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' ;;
  kernels) LIMIT=540 run kernels python3 -m pytest -q -x tests/gpu -m gpu \
               -k "not cuda_backend and not sm90" ;;
  check) LIMIT=300 run check1 torchrun --nproc-per-node=1 tests/gpu/dist_check.py ${CHECK_ARGS:-}
         [ "$NGPU" -ge 2 ] && LIMIT=300 run check2 torchrun --nproc-per-node=2 tests/gpu/dist_check.py ${CHECK_ARGS:-} ;;
  fp8kernels) LIMIT=300 run fp8kernels python3 -m pytest -q -s tests/gpu/test_kernel_checks_gpu.py -m gpu \
                  -k "fp8_kernel_checks and not mxfp8${FP8K:+ and ($FP8K)}" ;;
  mxkernels) LIMIT=240 run mxkernels python3 -m pytest -q tests/gpu/test_kernel_checks_gpu.py -m gpu -k mxfp8 ;;
  routing) LIMIT=180 run routing python3 -m pytest -q tests/gpu/test_routing_gpu.py -m gpu ;;
  nvkernels) LIMIT=240 run nvkernels python3 -m pytest -q tests/gpu/test_kernel_checks_gpu.py -m gpu \
                -k "nvfp4${NVK:+ and ($NVK)}" ;;
  sm90) LIMIT=300 run sm90 python3 -m pytest -q tests/gpu/test_grouped_gemm_sm90_gpu.py -m gpu \
            ${SM90_K:+-k "$SM90_K"} ;;
  megakernel) LIMIT=240 run megakernel python3 -m pytest -q tests/gpu/test_kernel_checks_gpu.py -m gpu -k mega ;;
  fenceprobe) probe=/tmp/fenceprobe; rm -rf $probe && mkdir -p $probe \
                && cp -r megatron_dist_moe csrc scripts $probe/ \
                && sed -i 's|^\( *\)fence_async_smem();$|\1// fenceprobe: no proxy fence|' \
                       $probe/csrc/nvfp4_wgmma_mm.cu
              if [ "$(grep -c 'fenceprobe: no proxy fence' $probe/csrc/nvfp4_wgmma_mm.cu)" != 1 ]; then
                echo "fenceprobe: the fence line was not found once; nothing run"; continue; fi
              NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
              for tree in "$PWD" $probe; do for g in w13 w2; do
                (cd "$tree" && PYTHONPATH=$tree LIMIT=120 run "fenceprobe_$(basename "$tree")_$g" \
                   "$NCU" --clock-control none -k regex:nvfp4_wgmma --launch-skip 2 --launch-count 1 \
                   --section SpeedOfLight python3 scripts/device/nvfp4_gemm_once.py --rows 192 \
                   --gemm $g)
              done; done
              grep -H -E 'Duration|DRAM Throughput' "$OUT"/fenceprobe_*.log ;;
  megatime) LIMIT=150 run megatime python3 scripts/device/mega_once.py --rounds 8
            LIMIT=150 run megatime_noh1 python3 scripts/device/mega_once.py --rounds 8 --no-h1
            NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
            [ -n "$NCU" ] && LIMIT=240 run megatime_ncu "$NCU" --clock-control none \
                -k regex:"mega_fwd|grouped_mm" --launch-skip 6 --launch-count 3 \
                --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
                python3 scripts/device/mega_once.py --rounds 0 ;;
  packing) LIMIT=240 run packing torchrun --nproc-per-node="$NGPU" tests/gpu/packing_check.py ${PACKING_ARGS:-} ;;
  inference) LIMIT=480 run inference torchrun --nproc-per-node="$NGPU" tests/gpu/inference_check.py \
                 --json "$OUT/inference.json" ${INFERENCE_ARGS:-} ;;
  traps) LIMIT=300 run traps python3 -m pytest -q tests/gpu/test_cuda_backend.py -m gpu -k device_traps ;;
  layer) LIMIT=300 run layer torchrun --nproc-per-node="$NGPU" benchmarks/bench_layer.py --out "$OUT" ${LAYER_ARGS:-} ;;
  baseline) [ -d "${BASE_TREE:-_base}" ] || { echo "baseline: no tree at ${BASE_TREE:-_base}"; continue; }
            (cd "${BASE_TREE:-_base}" && GIT_COMMIT=${BASE_COMMIT:-base} DIST_MOE_COMMIT=${BASE_COMMIT:-base} \
             PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} LIMIT=300 \
             run baseline torchrun --nproc-per-node="$NGPU" benchmarks/bench_layer.py --out "$OUT/baseline" ${BASE_LAYER_ARGS:-${LAYER_ARGS:-}}) ;;
  abtrees) [ -d "${BASE_TREE:-_base}" ] || { echo "abtrees: no tree at ${BASE_TREE:-_base}"; continue; }
           this_runs=""; base_runs=""
           ab_this() { LIMIT=200 run "abtrees_this_r$1" torchrun --nproc-per-node="$NGPU" \
                         benchmarks/bench_layer.py --out "$OUT/abtrees/this_r$1" ${LAYER_ARGS:-}; }
           ab_base() { (cd "${BASE_TREE:-_base}" && GIT_COMMIT=${BASE_COMMIT:-base} \
                        DIST_MOE_COMMIT=${BASE_COMMIT:-base} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} \
                        LIMIT=200 run "abtrees_base_r$1" torchrun --nproc-per-node="$NGPU" \
                        benchmarks/bench_layer.py --out "$OUT/abtrees/base_r$1" \
                        ${BASE_LAYER_ARGS:-${LAYER_ARGS:-}}); }
           for r in $(seq "${ROUNDS:-4}"); do
             # ABBA: odd rounds run this tree first, even rounds the baseline, so that a bias
             # tied to the order within a round cancels over pairs of rounds
             if [ $((r % 2)) = 1 ]; then ab_this "$r"; ab_base "$r"; else ab_base "$r"; ab_this "$r"; fi
             this_runs="$this_runs $OUT/abtrees/this_r$r"; base_runs="$base_runs $OUT/abtrees/base_r$r"
           done
           run abtrees python3 benchmarks/ab_trees.py --this $this_runs --base $base_runs \
               --out "$OUT/abtrees" ;;
  bench) LIMIT=400 run bench_gemm python3 benchmarks/bench_grouped_gemm.py --csv "$OUT/bench_gemm.csv" ${BENCH_ARGS:-} ;;
  quant) LIMIT=300 run quant python3 benchmarks/bench_quant.py --out "$OUT" ${QUANT_ARGS:-} ;;
  quantbase) [ -d "${BASE_TREE:-_base}" ] || { echo "quantbase: no tree at ${BASE_TREE:-_base}"; continue; }
             (cd "${BASE_TREE:-_base}" && GIT_COMMIT=${BASE_COMMIT:-base} \
              PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} LIMIT=300 \
              run quant_base python3 benchmarks/bench_quant.py --out "$OUT/quant_base" \
                  ${QUANT_BASE_ARGS:-${QUANT_ARGS:-}}) ;;
  fp8gemm) LIMIT=300 run fp8_gemm python3 benchmarks/bench_fp8_gemm.py --out "$OUT" ${FP8_ARGS:-} ;;
  nvfp4gemm) LIMIT=300 run nvfp4_gemm python3 benchmarks/bench_nvfp4_gemm.py --out "$OUT" ${NVFP4_ARGS:-} ;;
  claimsweep) run claimsweep python3 benchmarks/bench_grouped_gemm.py --kernels fwd_swiglu_claim,dgrad_w2_claim \
                 --claim-sweep --csv "$OUT/claim_sweep.csv" ;;
  ab) LIMIT=200 run ab torchrun --nproc-per-node="$NGPU" benchmarks/ab_layer.py --out "$OUT" \
          --a "${AB_A:-}" --b "${AB_B:-}" ${AB_ARGS:-} ;;
  sustained) LIMIT=${SUSTAINED_LIMIT:-150} run sustained torchrun --nproc-per-node="$NGPU" \
                 benchmarks/bench_sustained.py --out "$OUT" ${SUSTAINED_ARGS:-} ;;
  nvlink) run nvlink torchrun --nproc-per-node=2 benchmarks/bench_nvlink_rows.py --out "$OUT" --gemm ;;
  floor) LIMIT=240 run floor_sustained torchrun --nproc-per-node="$NGPU" benchmarks/bench_sustained.py \
             --out "$OUT/floor" --seconds 3 --idle-s 2 \
             --workloads dense_mm,gemms_triton,gemms_torch,dist_moe_fwd,dist_moe_fwdbwd ;;
  weights) LIMIT=120 run weights python3 benchmarks/bench_expert_weights.py --out "$OUT/weights" ;;
  decode) LIMIT=300 run decode torchrun --nproc-per-node="$NGPU" benchmarks/bench_decode.py --out "$OUT" ${DECODE_ARGS:-} ;;
  decodebase) [ -d "${BASE_TREE:-_base}" ] || { echo "decodebase: no tree at ${BASE_TREE:-_base}"; continue; }
              (cd "${BASE_TREE:-_base}" && GIT_COMMIT=${BASE_COMMIT:-base} \
               PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} LIMIT=300 \
               run decode_base torchrun --nproc-per-node="$NGPU" benchmarks/bench_decode.py \
                   --out "$OUT/decode_base" ${BASE_DECODE_ARGS:-${DECODE_ARGS:-}}) ;;
  packbench) run packbench torchrun --nproc-per-node="$NGPU" benchmarks/bench_packing.py --out "$OUT" ${PACK_ARGS:-} ;;
  megatron) # ~0.3 s per step per model at 2 microbatches; 3 models (alltoall twice: the noise band)
            for seed in ${SEEDS:-1234}; do
              TMO=${TMO:-590} run "megatron_$seed" torchrun --nproc-per-node="$NGPU" \
                examples/tiny_gpt_dist_moe.py --preset small --num-microbatches "${MB:-2}" \
                --steps "${STEPS:-300}" --compare --te off --seed "$seed" \
                --dist-moe-backend "${MOE_BACKEND:-cuda}" --repeat-alltoall \
                ${PERTURB:+--repeat-perturb "$PERTURB"} ${MEGATRON_ARGS:-} \
                --csv "$OUT/megatron_cmp_${MOE_BACKEND:-cuda}_$seed.csv"
              # the seed's verdict against its own noise band (a CSV cut short still has one)
              [ -s "$OUT/megatron_cmp_${MOE_BACKEND:-cuda}_$seed.csv" ] && LIMIT=60 \
                run "loss_noise_$seed" python3 benchmarks/megatron_loss_noise.py \
                  "$OUT/megatron_cmp_${MOE_BACKEND:-cuda}_$seed.csv" --out "$OUT/loss_noise_$seed"
            done ;;
  lmeval) band_args=""   # one run per seed (~10 s per model on one H200), then the verdicts
          for seed in ${LMEVAL_SEEDS:-1234}; do
            LIMIT=300 run lmeval_seed$seed torchrun --nproc-per-node="$NGPU" \
              examples/tiny_lm_nvfp4_eval.py --device cuda --hidden 1024 --ffn 2048 --experts 8 \
              --steps 300 --train-precisions bf16,fp8_block,mxfp8 --repeat-perturb 1e-3 \
              --repeats 6 --seed "$seed" --csv "$OUT/tiny_lm_seed$seed.csv" \
              --json "$OUT/tiny_lm_seed$seed.json" ${LMEVAL_ARGS:-}
            band_args="$band_args --seed $seed=$OUT/tiny_lm_seed$seed.csv"
          done
          run lm_noise_band python3 benchmarks/lm_noise_band.py $band_args --out "$OUT" ;;
  targets) LIMIT=300 run targets_layer torchrun --nproc-per-node="$NGPU" benchmarks/bench_layer.py \
               --out "$OUT/targets" --cases guide --paths dist_moe,dist_moe_mega,dist_moe_fp8_cached
           LIMIT=300 run targets_decode torchrun --nproc-per-node="$NGPU" benchmarks/bench_decode.py \
               --out "$OUT/targets" --tokens 1,8,32,128,512,1024,2048 --precisions bf16,nvfp4 --no-a2a
           LIMIT=300 run targets_fp8gemm python3 benchmarks/bench_fp8_gemm.py --out "$OUT/targets" ;;
  pack) tar czf /tmp/session.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/session.tgz "$OUT/" \
          && ls -la "$OUT" ;;
  *) echo "unknown section $s" ;;
esac; done
