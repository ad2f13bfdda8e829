#!/usr/bin/env bash
# On the GPU host (after `source .gpu/part2/activate.sh`): the end-to-end training work of one device
# call. Everything goes to $OUT (default outputs/gpu_train). Set CALL_LIMIT to the call's timeout_s: the
# script then stops CALL_MARGIN (25) s before it, so that its logs and tune cache still come back.
#
#   CALL_LIMIT=600 bash scripts/gpu_train.sh PHASE [PHASE ...]
#     hold     waits HOLD_S (60) s in one child process: CALL_LIMIT's own check (tests/test_compare.py)
#     gputests every GPU test (pytest -m gpu; GPU_TESTS="expr" runs those pytest -k selects), log in logs.tar
#              and the summary in $OUT/pytest_gpu.txt;
#              every derived bound with its measured value in $OUT/bounds.jsonl
#     fsdp2    (2+ GPUs) stock + compile vs CODA compiled under FSDP2 on NPROC GPUs (default 2), and on one GPU
#              (FSDP_PART=multi|single|both, FSDP_MODEL=1b|8b);
#              python -m scripts.report then generates the scaling table (tokens/s per GPU, efficiency)
#     fsdp2profile (2+ GPUs) one profiled step of the 1B compiled stock and CODA configs under FSDP2 on NPROC
#              GPUs (rank 0's trace): collectives and how much of them no compute overlaps
#     floor    python -m scripts.bench.floor: the step's floor (every GEMM at the best of cuBLAS and quack,
#              bf16 and fp8; FA4 fwd+bwd; fused AdamW), run it in the same lease as the step it judges;
#              quack at its default config (FLOOR_QUACK=tuned: its sweep, about 10 min: a call of its own)
#     liger    the Liger baseline (stock llama3 with Liger's RMSNorm, SiLU-mul, fused linear CE; carry .gpu/extra from
#              scripts/dev/extra_wheels.sh): its GPU test, then LIGER_ARMS (default stock, Liger, CODA, all compiled)
#     ligersteps the Liger model against stock over STEPS (60) steps of the debug model, eager, compiled, and with each
#              of its kernels as torch's math (scripts/probes/liger_steps.py; carry .gpu/extra too), then its GPU tests
#     headline the README's headline (about 8 min warm; HEADLINE_PART=fp8, then =bf16: two calls on a fresh host): the floor, then the compiled
#              fp8 pair (tag fp8_coda) and the compiled bf16 pair (untagged), each finding that floor in $OUT
#     allocexp the compiled pair of PREC (fp8, default; bf16) as the headline runs it, every run under TorchTitan's own
#              launcher setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (tag PREC_coda_expandable): the reserved
#              peaks without the caching allocator's fragmentation (steps 1-10 hold about 3 GiB more than steady state)
#     allocstreams the compiled CODA config of PREC (fp8, default; bf16) as configured (arm on), without optimizer_stream
#              and its chunked step (noopt), without input_stream (noinput), without the weight prefetch (noprefetch);
#              ARMS (default all four), STEPS (20) after 10 each, tags PREC_streams_ARM, PYTORCH_CUDA_ALLOC_CONF as the
#              call's: each run's reserved memory by CUDA stream after its last step (alloc_streams in its JSON)
#     check    FA4 GPU tests, then 12 steps of the 1B coda_compile config (inductor + cute ops + FA4)
#     warm     WARM_STEPS (6) steps of the compiled CODA and stock configs (PREC, default bf16), nothing kept: their
#              kernels and inductor graphs compiled into this host's caches, so that the next call (within the 30 s a host
#              stays warm) trains at once. Before parity: a fresh host's first CODA run compiles for about 200 s (339 s
#              for 300 bf16 steps against about 120 s warm), and parity's three runs then pass the 600 s a call may take.
#              It took 297 s on a fresh H200 (bf16); the parity call after it on that host then took 383 s
#     compare  python -m scripts.compare over the four 1B BF16 configs (50 timed steps after 10 warm-up)
#     parity   python -m scripts.compare --loss-curve, 1B stock eager vs CODA compiled (PARITY_CODA: another CODA config) and
#              vs stock compiled (the bf16 noise floor: issue 18's criterion, judged on the results page), 300 steps
#     profile  python -m scripts.compare --profile of the 1B coda and compiled baseline configs
#     families the floor, then profiles of the compiled 1B CODA and stock configs (PRECISION=bf16|fp8): the
#              GEMM-family table (CODA ms, stock ms, floor ms per family and direction)
#     sdpa     the compiled baseline and CODA with SDPA instead of FA4 on both sides
#     fp8      TorchTitan's float8 baselines (tensorwise compiled and eager, rowwise compiled) vs bf16
#     8b       the 8B pair for 15 steps each (does it fit one GPU; tokens/s); COMPILE=1: both compiled
#     hostoverhead probe: host time per call of each program beside its GPU time (GPU idle between kernels)
#     knobab   KNOB="key = value" on the compiled CODA config between two runs as configured (PREC, STEPS, LOG_FREQ, TAG;
#              VARIANT_OF=configs/….toml another CODA config, e.g. an 8B one whose optimizer steps on the main stream)
#     overlap      overlapped pingpong epilogues: GPU tests (same bits), then B3, F1 and B2 timed plain / overlapped
#     optstream    the GPU test of [coda] optimizer_stream, then float8 + compile vs CODA fp8 compiled with it on / off
#     optstreambf16 stock + compile vs CODA bf16 compiled with [coda] optimizer_stream on / off
#     fusedclip    the compiled baseline vs CODA compiled with [coda] fused_clip on / off (PREC=fp8 (default) or bf16)
#     fusedclipparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fused_clip, and without
#     downdgradov  CODA fp8 compiled with fp8_down_dgrad (B3 on fp8, overlapped epilogues) against its defaults
#     ncustalls   Nsight Compute on one call of B3 (NCU_PROGRAMS): its warp-state counters and per-SASS stall samples
#     phases   probe: the host's time per training step by phase, and the phases the slow steps grow in
#     hostslack probe: host-bound GPU idle of the forward from the step with and without a GPU sleep (no profiler)
#     hostprofile probe: cProfile of each program's calls, its host time by package and function
#     hostlayers probe: each program's host time per call by layer (custom op, backend, our kernel, quack), no profiler
#     oplayers probe: torch's custom-op layer per call (autograd, dispatch, alias check), a lean CUDA registration
#     lmheadscale probe: F4's backward scaling, two products against one foreach product (bits, ms)
#     qgrad      GPU tests of quantize_grad's Triton passes, then scripts/probes/quantize_grad.py (bits, ms per call)
#     qgradab    the compiled baseline and CODA compiled with those passes, then with the previous kernels
#                (CODA_TITAN_CAST_PASS=inductor), PREC=fp8 (default), LOG_FREQ (default 10)
#     pkgab      CODA compiled with an earlier commit's package (.gpu/base.tgz, carried), as checked out, with
#                ENV_B="NAME=VALUE" if given, and the earlier package again (PREC, STEPS, LOG_FREQ, TAG)
#     profile8b one profiled step of the 8B bf16 pair with compile and full AC (one GPU)
#     sustained  probe: bf16 B3, F2 and B2 tile configs in a short burst and at the power cap (calls back to back)
#     b3ab8b   the 8B bf16 CODA config (compiled) with B3 on quack's epilogue and base, then the 8B pair as configured
#     fp88b    the 8B fp8 pair (float8 + compile vs CODA fp8 compiled), 15 steps each: does it fit one GPU
#     fp88bmem the 8B CODA fp8 config without the transposed e4m3 weights (its peak against fp88b's)
#     weighttbwd the 8B CODA fp8 config with [coda] fp8_weight_t_bwd (W^T made in each backward)
#     fp8check   GPU tests of the fp8 programs, then 12 steps of the 1B fp8 coda config
#     bench      python -m scripts.bench.kernels (bf16) at DIMS (default 2048): the kernel table, one d a call
#     pinab      stock + compile and CODA compiled with pin_memory = false against the configs (PREC=fp8 or bf16)
#     inputstream stock + compile and CODA compiled, each as configured and with [coda] input_stream, logging every
#                LOG_FREQ steps (default 10, the configs' own) (PREC=fp8 or bf16)
#     inputstreameager the eager CODA fp8 config as configured (input_stream on) and with it off, LOG_FREQ as above
#     b3stages   the kernel bench's B3 (bf16) on quack's epilogue and base against our copy at b2_c_stages's base, and B2
#     fp8bench   python -m scripts.bench.kernels --precision fp8 at d = 2048 (1B); AT_CAP as bench
#                (BENCH_OPS="op ..." benches those programs only)
#     fp8compare float8 baseline (compiled) vs CODA fp8 (eager, compiled) vs CODA bf16 (50 timed steps)
#     fp8mlp     as fp8compare without CODA bf16, with [coda] fp8_mlp_dgrad = true on the CODA configs
#     fp8wgrad   float8 baseline (compiled) vs CODA fp8 compiled with [coda] fp8_mlp_wgrad = true and = false (A/B)
#     fp8model   the whole-model GPU test of the fp8 programs only
#     fp8down    float8 baseline (compiled) vs CODA fp8 compiled with [coda] fp8_down_proj and fp8_out_proj on / off (A/B)
#     fp8downdgrad float8 baseline (compiled) vs CODA fp8 compiled with [coda] fp8_down_dgrad on / off (A/B)
#     qdat         float8 baseline (compiled) vs CODA fp8 compiled with fp8_down_dgrad (the transposed B3 on fp8), with
#                  fp8_down_wgrad too, and as configured
#     cechunks     probe: the LM head + CE program per ce_chunk_rows against the full head's bare GEMMs
#     ceab         CODA compiled with [coda] ce_chunk_rows = 8192 and 16384 (CE_ROWS="2048 ...": those) against the
#                  configs' 4096, with the compiled baseline (PREC=fp8 (default) or bf16); 2048 trades time for memory
#     qkvwgradcause 300-step curves: fp8_qkv_wgrad with a current-scaled gradient cast (fp8_dgrad off), float8, configured
#     fa4layouts   probe: FA4 forward / backward per q, k, v layout (contiguous, CODA's packed slices, k/v copied, head-major,
#                  q apart from a k v buffer), then F3 on all of W_qkv against F3 as two or three calls on its row slices
#     b3configs    probe: B3 (the defaults' transposed e5m2 B3, on bf16 and fp8 GEMMs) per quack tile config, and
#                  the bare fp8 GEMM (CONFIGS="i ..." picks configs of scripts/probes/fp8_configs.py; B3="k ..." the
#                  kernels, e.g. plain_fp8 c_only_fp8 b3_nt_q b3_t_q: the split of B3's time)
#     tstore       probe: B3's transposed 8-bit stores through stmatrix.trans against quack's universal copy (bits
#                  after de-interleaving the tokens, and time; scripts/probes/fp8_trans_store.py)
#     fp8transpose probe: the weight pass's transposed e4m3 copies, aten's against inductor's (scripts/probes/fp8_transpose.py)
#     ropebwd      probe: B1 (the RoPE backward pass) as shipped against rewrites of the same arithmetic (scripts/probes/rope_bwd.py)
#     b1pass       B1 as one Triton pass (the default) against the inductor program (CODA_TITAN_B1_PASS=inductor): the compiled
#                  baseline and CODA compiled with the pass, then CODA compiled with the program (fp8_dgrad is on by
#                  default since the twenty-fifth session: its own arm is gone), PREC=fp8 (default) or bf16
#                  (two tables: b1_triton_PREC, b1_inductor_PREC)
#     cepass       F4's gradient pass in place (Triton, the last dW GEMM writing bf16; the default) against the previous
#                  program (CODA_TITAN_CE_PASS=inductor): the compiled baseline and CODA compiled with the pass, then CODA
#                  compiled with the program, PREC=fp8 (default) or bf16 (two tables: ce_triton_PREC, ce_inductor_PREC)
#     b1probe      scripts/probes/b1_pass.py: B1's Triton pass (a program per row) against a rewrite over blocks of heads
#                  (2, 4, 8 warps; dropped), bf16 and fp8, bits and GPU ms beside the memory time
#     foldsprobe   scripts/probes/folds.py: the fp8 epilogues' partial folds as the step runs them against one launch
#                  (amax: fold_amax; B3's zdz and B2's dgamma: a 2-d tile a program), time and agreement
#     adamw8b      the 8B CODA config (PREC8B: fp8 or bf16) compiled without and with [coda] coda_adamw (its step on the
#                  main stream there), STEPS (8) after 7 warm-up each; ARMS (default "off on off2")
#     preactprobe  scripts/probes/preact.py: [coda] fp8_preact's F2 and B3 against the bf16-a ones (ms at the cap, bits)
#     b3math       scripts/probes/b3_math.py: the fp8 B3 against the same kernel with one multiply an output (its
#                  arithmetic's share of its time, at the cap)
#     fa4accum     scripts/probes/fa4_accum_layout.py: the storage order of FA4's fp32 dq / dk / dv accumulators (SM90)
#     lmheadfp8    scripts/probes/lm_head_fp8.py: the 1B LM head's GEMMs in bf16 (as run) against fp8 tensorwise, at the cap
#     fp8head      the fp8 LM head (fp8_lm_head): its GPU tests, then lm_head_fp8 --programs (its program against the bf16 head's)
#     fp8headparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_lm_head, and as configured
#     fp8headfwdparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_lm_head_fwd, and as configured
#     fp8headdw    CODA fp8 compiled as configured (fp8_lm_head_dw on: dW_out on stochastically rounded e5m2 dlogits),
#                  without it, as configured, without it again (STEPS, default 30); after GPU_TESTS="fp8_forward_head" gputests
#     codest       CODA fp8 compiled as configured, without and with CODA_TITAN_CE_CODES_T=1 (ce_codes_t: the CE pass
#                  stores fp8_lm_head_dw's codes token-major itself, no transpose), alternating twice (STEPS, default 30)
#     dwblocks     CODA fp8 compiled as configured with fp8_lm_head_dw's dW over 1, 2, 4, 1, 2 token blocks
#                  (CODA_TITAN_DW_BLOCKS: the code buffer a block wide; its peak memory and step; STEPS, default 30;
#                  each run killed after ARM_TIMEOUT s, default 300; after dwblocksprobe on the host: its tile sweeps)
#     dwblocksparity 300-step loss curves (tag fp8_lm_head_dw_blocks<k>, DW_BLOCKS = k, default 2; ONLY_CANDIDATE=1
#                  as below): float8 + compile, CODA fp8 compiled under CODA_TITAN_DW_BLOCKS=k, and as configured
#     fp8headdgrad CODA fp8 compiled with [coda] fp8_lm_head_dgrad (the head's B2 on fp8_lm_head_dw's stochastic e5m2
#                  codes and W^T's e4m3 codes, no bf16 dlogits) and as configured, in the order DGRAD_ARMS (default
#                  "on off on2 off2"; tags fp8headdgrad_ARM; STEPS, 30; each run killed after ARM_TIMEOUT s, 300)
#     dgradprobe   scripts/probes/lm_head_fp8.py --programs-only: the head's programs at the cap, the configured one
#                  without and with fp8_lm_head_dgrad among them (the kernel-level size of that lever)
#     fp8headdgradparity 300-step loss curves (tag fp8_lm_head_dgrad_tx; ONLY_CANDIDATE=1 as below): float8 + compile,
#                  CODA fp8 compiled with fp8_lm_head_dgrad, and as configured
#     fp8headdwparity 300-step loss curves (tag fp8_lm_head_dw_sr; ONLY_CANDIDATE=1: without the configured run): float8
#                  + compile, CODA fp8 compiled with fp8_lm_head_fwd and fp8_lm_head_dw,
#                  and as configured
#     fp8repeats   three 300-step curves of float8 + compile alone (the H200 cohort's repeat spread, by which every fp8
#                  candidate of that GPU is judged, had one pair on 2026-11-29)
#     envab        ENV_B="NAME=VALUE" between runs of the compiled CODA config as configured (PREC): off, on, off2, on2
#     b1accum      scripts/probes/b1_accum.py: B1 reading FA4's fp32 gradient accumulators against the postprocess + B1
#     preactparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_preact, and as configured
#     preactab     CODA fp8 compiled without fp8_preact at 2048 LM-head rows (off: the configs before 2026-11-30),
#                  with it (on), with it and ce_chunk_rows = 4096 (on4096: as configured since), in the order
#                  PREACT_ARMS (default "off on on4096 off2 on2"; STEPS, 30; tags preact_ARM; each run killed
#                  after ARM_TIMEOUT s, default 300)
#     adamwprobe   scripts/probes/adamw.py: torch's fused AdamW against [coda] coda_adamw on the 1B parameters (ms, bits);
#                  beside it torch's fused_adam_utils.cuh as this host's torch ships it (adamw_functor.cuh)
#     ceexp        CODA compiled with F4 without its gradient pass (CODA_TITAN_CE_PASS=exp) against the configured F4 and
#                  its pass (PREC, default bf16; ARMS=3 repeats the configured run)
#     ceexpprofile one profiled step of CODA compiled with and without F4's gradient pass (PREC), under $out/ceexp/
#     dwblocksprobe scripts/probes/fp8_dw_blocks.py: fp8_lm_head_dw's dW as configured (one cuBLAS fp8 GEMM) against
#                  CODA_TITAN_DW_BLOCKS=2, 4 (quack fp8 GEMMs a block): each arm's first call (its autotune sweep, then
#                  kept in the returned tune cache), ms and difference; before dwblocks on a host
#     cepassprobe  scripts/probes/ce_pass.py: F4's in-place Triton pass (block / warp shapes) against the inductor program,
#                  and the last dW GEMM writing bf16 against the fp32 sum then a cast; the configured pass alone, with e5m2 codes, with
#                  stochastically rounded codes (fp8_lm_head_dw's)
#     dw2reuse     dW2 on B3's e5m2 D (the default) against dW2 casting D again (CODA_TITAN_DW2_RECAST=1): float8 + compile
#                  and CODA fp8 compiled, then CODA fp8 compiled recasting (tables dw2_reuse, dw2_recast)
#     stepchunks   the compiled baseline, CODA compiled as configured, and with [coda] step_chunk_layers = C (the optimizer
#                  step on its stream in layer chunks; each block of the next forward waits for its own) for C in CHUNKS
#                  (default "4 1"), PREC=fp8 (default) or bf16 (table step_chunks_PREC)
#     mlpht        float8 baseline (compiled) vs CODA fp8 compiled with [coda] fp8_mlp_h_t on / off (A/B)
#     mlphtparity  300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_mlp_h_t, and without
#     bf16acc      scripts/probes/bf16_step_accuracy.py: one bf16 step's gradients of stock eager / compiled and CODA
#                  eager / compiled against the same step in fp32 (1B, seq 8192 x 2), and against stock eager;
#                  STATE_STEPS=N: from the weights after N steps of stock eager (trained first) and its next batch;
#                  MODELS="stock_eager coda_eager": those models only (also torch_eager, and the AMP models
#                  stock_amp, coda_amp, stock_amp_bf16_stream: the file then ends _amp; the bisection arms
#                  coda_eager_fa4_unpacked, coda_eager_ref_{f3,b1,b2,wgrad,attn,all}: the probe's docstring);
#                  TENSORS=1: also per layer the residual stream, attention inputs and output, their gradients
#     weightdrift  scripts/probes/weight_drift.py: bf16 runs' weights after 20 and 40 steps (before the first loss
#                  spike), per parameter kind, against stock eager's and stock AMP's (WD_ARMS, WD_STEPS)
#     ceslack      scripts/probes/ce_offset_slack.py: the Cauchy-Schwarz bound's slack over each LM-head row's largest
#                  logit (an F4 without its gradient pass needs it under 157) at the init weights and after
#                  SLACK_STEPS (default "0 46 300") steps of stock eager (each trained first, about 3 min for 300)
#     qkvwgrad     float8 baseline (compiled) vs CODA fp8 compiled with [coda] fp8_qkv_wgrad on / off (A/B)
#     qkvdgrad     GPU tests of the fp8 B1 -> B2, then float8 + compile vs CODA fp8 compiled with [coda] fp8_dgrad on / off
#     epistages    B2 with a lower C-stage base (CODA_TITAN_EPI_C_STAGES): GPU test, then scripts/probes/epi_stages.py
#                  (INTERLEAVE=N: then N alternations of the tuned op and the pinned tile)
#     epibase      [coda] b2_c_stages = 2 against quack's base: the compiled baseline, CODA compiled with it, as configured (PREC)
#     qkvdgradprofile one profiled step of CODA fp8 compiled with fp8_dgrad (against fp8profile's of the defaults)
#     t8probe      probe: the 8-bit token-major copy (transpose_8bit's Triton pass per tile, eager torch, inductor)
#     t8ab         fp8_qkv_wgrad (B1's codes copied by transpose_8bit) against the configured fp8 config
#     t8mem        CODA fp8 compiled with dW_o's token-major copies by transpose_8bit, then by inductor (CODA_TITAN_T8=inductor)
#     lmheaddw     probe: the LM head's dW, CODA's chunks against cuBLAS chunks and one GEMM (ce-like and random data)
#     lcescaledexp probe: the LM head, CODA's program against quack's chunked and scaled-exp linear-CE pipelines
#     t8env        CODA fp8 compiled under CODA_TITAN_T8=$T8 (every token-major copy by inductor, or by transpose_8bit)
#     t8parity     300-step loss curves: float8 + compile and CODA fp8 compiled with fp8_qkv_wgrad
#     htprofile    one profiled step of the fp8 defaults and of fp8_qkv_wgrad's arm (where its 2.8 ms go)
#     qkvwgradparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_qkv_wgrad, and without
#     qkvdgradparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_dgrad, and without
#     actmargin    300-step loss curves: float8 + compile, CODA fp8 eager as configured and with fp8_act_margin = 0
#                  (the clamp counts of each run in $OUT/clamped.txt)
#     fp8sites     300-step loss curves: float8 + compile, CODA fp8 eager with its backward in bf16 and with the W2 / W_o
#                  inputs in bf16 (which sites move CODA fp8 off float8's consensus curve; docs/results.md);
#                  SITES="bwd" or "fwd" runs one arm (the three curves do not fit one call)
#     qdatparity   300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_down_dgrad and fp8_down_wgrad, and without
#     fp8layerwgrads float8 baseline (compiled) vs CODA fp8 compiled with [coda] fp8_layer_wgrads on / off (A/B)
#     tracepasses  stock / float8 + compile vs CODA compiled with [coda] trace_passes on / off (A/B), fp8 and bf16
#     fp8downs     float8 baseline (compiled) vs CODA fp8 compiled as configured, + fp8_down_proj, + both F1 input sites
#     graphs       compiled baseline vs CODA compiled as configured and with [coda] cuda_graphs (fp8: also with both
#                  F1 input sites on fp8), PREC=fp8 (default) or bf16
#     downout      float8 baseline (compiled) vs CODA fp8 compiled with both F1 input sites on fp8 (no graphs)
#     downoutparity 300-step loss curves: float8 + compile, CODA fp8 compiled with both F1 input sites on fp8, and without
#     e5m2wgrad    float8 baseline (compiled) vs CODA fp8 compiled with [coda] fp8_mlp_wgrad_e5m2 on / off (A/B)
#     e5m2wgradparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_mlp_wgrad_e5m2, and without
#     downwgrad    float8 baseline (compiled) vs CODA fp8 compiled with [coda] fp8_down_wgrad on / off (A/B)
#     downwgradparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_down_wgrad, and without
#     dat          float8 baseline (compiled) vs CODA fp8 compiled with [coda] fp8_mlp_da_t on / off (A/B)
#     datdown      the same with fp8_down_wgrad on in both arms (B3's y^T too, against y's copy pass)
#     datdownparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_mlp_da_t and fp8_down_wgrad, and without
#     prefetch     float8 baseline (compiled) vs CODA fp8 compiled with [coda] prefetch_weights on / off (A/B)
#     fp8downdgradparity 300-step loss curves: float8 + compile, CODA fp8 compiled with fp8_down_dgrad, and without
#     fp8downprofile one profiled step of the fp8down A/B's "down" arm (both flags on)
#     fp8store   probe: F2 storing y as e4m3 from its epilogue on SM90, against bf16 y (+ a cast pass)
#     fp8parity  python -m scripts.compare --loss-curve, float8 baseline (compiled) vs CODA fp8 and vs eager float8 (its noise floor), 300 steps
#     fp8paritydefaults fp8parity less the eager float8 run (it fits one call): float8 + compile against CODA fp8 eager
#     fp8profile python -m scripts.compare --profile of the float8 baseline (compiled) and of CODA fp8 (compiled);
#                SKIP_BASELINE=1 skips the baseline, KEEP_TRACE=1 also returns the gzipped chrome traces
#
# Result JSON go to $OUT (no PNG: `scripts.report` draws them here); logs go to $OUT/logs.tar (the device tool
# returns at most 8 files).
# quack's autotune results are kept in $CODA_TITAN_CACHE; if .gpu/tune.tar holds a copy from an earlier
# call it is restored first, and the cache is saved to $OUT/tune.tar at the end, so a fresh host does
# not re-tune (the tuning result is a choice among kernel configs; it does not change numerics).
set -uo pipefail
out=${OUT:-outputs/gpu_train}; mkdir -p "$out"
logs=/tmp/gpu_logs; mkdir -p "$logs"
export CODA_TITAN_CACHE=${CODA_TITAN_CACHE:-/tmp/coda_cache} PYTHONUNBUFFERED=1 WANDB_SILENT=true
# (.gpu/tune.tar: this machine's merged copy; else scripts/gpu_cache/tune.tar.gz, the committed one (gzipped: the
# device tool carries 64 MiB, the offline bundle's part2 takes 51 of them), so that a fresh
# checkout's first call does not spend its device time re-tuning)
for t in .gpu/tune.tar scripts/gpu_cache/tune.tar.gz; do
  if [ -f "$t" ]; then mkdir -p "$CODA_TITAN_CACHE" && tar xf "$t" -C "$CODA_TITAN_CACHE"; break; fi
done
# (.gpu/extra/*.whl: pure-Python wheels the offline bundle lacks, liger-kernel for the Liger baseline;
# scripts/dev/extra_wheels.sh downloads them, the call carries ".gpu/extra" beside ".gpu/part2")
if compgen -G ".gpu/extra/*.whl" > /dev/null; then
  for w in .gpu/extra/*.whl; do python3 -m zipfile -e "$w" /tmp/coda_extra; done
  export PYTHONPATH=/tmp/coda_extra${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch, torchtitan; print('torch', torch.__version__, torch.cuda.get_device_name(), '| torchtitan', torchtitan.__version__)" | tee "$logs/env.txt"
finish() {
  [ -n "${watchdog:-}" ] && { pkill -P "$watchdog"; kill "$watchdog"; } 2>/dev/null
  (cd "$CODA_TITAN_CACHE" && find . -name '*.autotune.json' -o -path './tokenizers/*' -type f | tar cf "$out/tune.tar" -T -)
  for d in /tmp/compare/*/; do [ -f "$d/train.log" ] && cp "$d/train.log" "$logs/$(basename "$d").log"; done
  tar cf "$out/logs.tar" -C "$logs" .
}
trap finish EXIT
trap 'exit 143' TERM  # (timeout signals the whole process group: the phase dies, finish still returns the cache and logs)
# CALL_LIMIT=S (the device call's timeout_s): CALL_MARGIN (25) s before it, every process under this script and
# then the script are stopped (TERM), so that finish still returns the tune cache and the logs, which a call
# killed at its limit loses (and the run.log the command writes under $OUT comes back whole)
stop_tree() { local c; for c in $(pgrep -P "$1"); do stop_tree "$c"; kill -TERM "$c"; done 2>/dev/null; }
if [ -n "${CALL_LIMIT:-}" ]; then
  (
    s=$((CALL_LIMIT - ${CALL_MARGIN:-25} - SECONDS)); [ "$s" -gt 0 ] && sleep "$s"
    echo "=== CALL_LIMIT: stopping the phase at $(date +%T), ${CALL_MARGIN:-25} s before the call's limit"
    kill -TERM $$  # (first: the script takes its trap as soon as the child it waits on is gone, starting nothing)
    for c in $(pgrep -P $$); do [ "$c" = "$BASHPID" ] || { stop_tree "$c"; kill -TERM "$c"; }; done 2>/dev/null
  ) &
  watchdog=$!
fi
cmp="python3 -m scripts.compare --out $out --workdir /tmp/compare --no-plot"  # (the report draws the plots: a call returns 8 files)
# armrun CONFIG TAG: one arm of an A/B (STEPS timed steps, default 30, after 10; LOG_FREQ, default 10), written under
# TAG and killed after ARM_TIMEOUT s (default 300); an environment switch before it reaches the run
armrun() {
  $cmp "$1" --steps "${STEPS:-30}" --warmup 10 --log-freq "${LOG_FREQ:-10}" --tag "$2" --timeout "${ARM_TIMEOUT:-300}"
}
# probe PHASE MODULE PATTERN [WIDTH]: python3 -m scripts.probes.MODULE (its log: $logs/MODULE.log), its return code,
# and the log's lines matching PATTERN, cut to WIDTH (400) characters
probe() {
  python3 -m "scripts.probes.$2" > "$logs/$2.log" 2>&1
  echo "$1 rc=$?"; grep -E "$3" "$logs/$2.log" | cut -c1-"${4:-400}"
}
# variant NAME "KEY = VALUE" ...: the compiled CODA fp8 config with those [coda] lines, as /tmp/<stem>_NAME.toml
# (an A/B arm: variant stems have no target; the table sets them against the compiled baseline)
# (PREC=bf16: of the compiled CODA bf16 config; VARIANT_OF=CONFIG: of that config)
variant() {
  local base=${VARIANT_OF:-configs/llama3_1b_${PREC:-fp8}_coda_compile.toml} lines="" l v
  v=/tmp/$(basename "$base" .toml)_$1.toml; shift
  local drop=()  # (a key the base config sets already is replaced, not repeated: TOML refuses a duplicate)
  for l in "$@"; do lines="$lines\n$l"; drop+=(-e "/^${l%% =*} = /d"); done
  sed "${drop[@]}" "$base" | sed "s/^\[coda\]$/[coda]$lines/" > "$v"
  for l in "$@"; do grep -qx "$l" "$v" || { echo "could not derive $v" >&2; return 1; }; done
  echo "$v"
}
# ab TAG ON OFF KEY ...: the A/B of [coda] knobs: float8 + compile against the compiled CODA fp8 config
# with every KEY = true (arm ON) and every KEY = false (arm OFF), 50 timed steps, written under TAG
# (PREC=bf16: stock + compile against the compiled CODA bf16 config)
ab() {
  local tag=$1 on=$2 off=$3 k a b yes=() no=(); shift 3
  for k in "$@"; do yes+=("$k = true"); no+=("$k = false"); done
  a=$(variant "$on" "${yes[@]}") && b=$(variant "$off" "${no[@]}") || exit 2
  $cmp configs/llama3_1b_${PREC:-fp8}_baseline_compile.toml "$a" "$b" --steps "${STEPS:-50}" --warmup 10 --tag "$tag"
}
# curves TAG NAME "KEY = VALUE" ...: the 300-step loss curves (PARITY_STEPS) that making those [coda] lines the
# default waits for: float8 + compile, the compiled CODA fp8 config with them (variant NAME), and as configured
curves() {
  local tag=$1 a; shift
  a=$(variant "$@") || exit 2
  local c=configs/llama3_1b_fp8_coda_compile.toml  # (ONLY_CANDIDATE=1: without the configured run)
  [ -n "${ONLY_CANDIDATE:-}" ] && c=""
  $cmp --loss-curve configs/llama3_1b_fp8_baseline_compile.toml "$a" $c \
    --steps "${PARITY_STEPS:-300}" --tag "$tag"
}
# envab ON OFF VAR=VALUE: an A/B of an environment switch (PREC=fp8 or bf16): the compiled baseline and the
# compiled CODA config as they are (tag ON), then the compiled CODA config under VAR=VALUE (tag OFF), one after the other
envab() {  # (LOG_FREQ=N: both comparisons log every N steps, as the configs do)
  local p=${PREC:-fp8} lf=${LOG_FREQ:+--log-freq $LOG_FREQ}
  $cmp configs/llama3_1b_${p}_baseline_compile.toml configs/llama3_1b_${p}_coda_compile.toml \
    --steps "${STEPS:-50}" --warmup 10 --tag "$1" $lf
  env "$3" $cmp configs/llama3_1b_${p}_coda_compile.toml --steps "${STEPS:-50}" --warmup 10 --tag "$2" $lf
}
# floor_default: the 1B floor with quack at its default config (a minute), its totals printed
floor_default() {  # SKIP_FLOOR=1: none (a floor of this lease already in benchmarks/results serves)
  [ -n "${SKIP_FLOOR:-}" ] && return
  python3 -m scripts.bench.floor --model 1B --quack "${FLOOR_QUACK:-default}" > "$logs/floor.log" 2>&1
  echo "floor rc=$?"; grep -E "floor|FA4|AdamW" "$logs/floor.log" | tail -6
}
keep=${KEEP_TRACE:+--keep-trace}  # KEEP_TRACE=1: the profile phases also return the gzipped chrome traces
for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  t0=$SECONDS
  case $phase in
    gputests)
      rm -f "$out/bounds.jsonl"
      CODA_BOUNDS_LOG="$out/bounds.jsonl" python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -rfE --tb=short -W ignore::DeprecationWarning \
        ${GPU_TESTS:+-k "$GPU_TESTS"} > "$logs/pytest_gpu.txt" 2>&1
      echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^E " "$logs/pytest_gpu.txt" | tail -25 | tee "$out/pytest_gpu.txt"
      ;;
    fsdp2)
      # (a multi-GPU kind: nvidia-h200-x2 or larger) stock + compile vs CODA compiled, FSDP2 over NPROC GPUs
      # (FSDP_PART=multi), then the same pair on one GPU of the same host (FSDP_PART=single; default both):
      # tokens/s per GPU, scaling efficiency and loss parity. FSDP_MODEL=1b (100 steps, default) or 8b
      # (the 8B configs with compile on: 100 steps sharded and 100 on one GPU, about 5.5 and 2 min per
      # pair on H200s: 8B's early steps spike, so its loss parity needs the one-GPU pair's beside it)
      case ${FSDP_MODEL:-1b} in
        1b) pair="configs/llama3_1b_bf16_baseline_compile.toml configs/llama3_1b_bf16_coda_compile.toml"
            fs=(--steps "${STEPS:-90}" --warmup 10); one=("${fs[@]}"); sfx="" ;;
        8b) pair="configs/llama3_8b_bf16_baseline.toml configs/llama3_8b_bf16_coda.toml"
            fs=(--steps "${STEPS:-93}" --warmup 7 --set compile.enable=true)
            one=(--steps "${SINGLE_STEPS:-93}" --warmup 7 --set compile.enable=true); sfx=_8b ;;
        *) echo "FSDP_MODEL is 1b or 8b"; exit 2 ;;
      esac
      [ "${FSDP_PART:-both}" = single ] || $cmp --nproc "${NPROC:-2}" $pair "${fs[@]}" --tag "fsdp${NPROC:-2}$sfx"
      [ "${FSDP_PART:-both}" = multi ] || CUDA_VISIBLE_DEVICES=${SINGLE_GPU:-0} $cmp $pair "${one[@]}" --tag "fsdp1$sfx"
      ;;
    fsdp2profile)
      for c in configs/llama3_1b_bf16_baseline_compile.toml configs/llama3_1b_bf16_coda_compile.toml; do
        $cmp --profile --nproc "${NPROC:-2}" "$c" --steps 15 $keep
      done
      ;;
    floor)
      python3 -m scripts.bench.floor --model "${FLOOR_MODEL:-1B}" --quack "${FLOOR_QUACK:-default}" > "$logs/floor.log" 2>&1
      echo "floor rc=$?"; grep -v "^    (" "$logs/floor.log" | tail -40
      ;;
    headline)
      # (as the configs train: a metrics line, and its .item() wait, every LOG_FREQ steps; 1: every step, as
      # every headline before the thirty-seventh session)
      # HEADLINE_PART=fp8: the floor and the fp8 pair, the floor also kept on the host (/tmp/coda_floor);
      # HEADLINE_PART=bf16, the next call on that warm host: the kept floor back into $OUT, then the bf16 pair.
      # (A fresh host compiles each config for about 150 s, so the whole headline passes the 600 s a call may take.)
      part=${HEADLINE_PART:-all}
      if [ "$part" = bf16 ]; then
        cp /tmp/coda_floor/floor_*.json "$out/" || { echo "no floor kept on this host: run HEADLINE_PART=fp8 first"; exit 2; }
      else
        floor_default
        mkdir -p /tmp/coda_floor && cp "$out"/floor_*.json /tmp/coda_floor/ 2>/dev/null
      fi
      [ "$part" = bf16 ] || $cmp configs/llama3_1b_fp8_baseline_compile.toml configs/llama3_1b_fp8_coda_compile.toml \
        --steps "${STEPS:-50}" --warmup 10 --log-freq "${LOG_FREQ:-10}" --tag fp8_coda
      [ "$part" = fp8 ] || $cmp configs/llama3_1b_bf16_baseline_compile.toml configs/llama3_1b_bf16_coda_compile.toml \
        --steps "${STEPS:-50}" --warmup 10 --log-freq "${LOG_FREQ:-10}"
      ;;
    liger)
      # the Liger baseline (model.name = "liger_llama3"; needs .gpu/extra's liger-kernel wheel): the configs of
      # LIGER_ARMS in one comparison, tag TAG (default liger), STEPS (50) after 10, LOG_FREQ (10); first its GPU tests
      python3 -c "from coda_titan.titan.liger import liger_unavailable_reason as r; w = r(); print(w or 'liger: ok'); exit(bool(w))" \
        || exit 2
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_liger.py -rfE --tb=short 2>&1 | tail -3
      lc=(); for a in ${LIGER_ARMS:-baseline_compile liger_compile coda_compile}; do lc+=("configs/llama3_1b_bf16_$a.toml"); done
      [ -n "${LIGER_ARMS-x}" ] && $cmp "${lc[@]}" --steps "${STEPS:-50}" --warmup 10 --log-freq "${LOG_FREQ:-10}" \
        --tag "${TAG:-liger}"
      # LIGER_BISECT="rms_norm silu_mul linear_ce": then the compiled Liger config once per name with that kernel as
      # torch's math (CODA_TITAN_LIGER_TORCH_OPS), tags liger_torch_NAME: which kernel moves the loss
      for op in ${LIGER_BISECT:-}; do
        CODA_TITAN_LIGER_TORCH_OPS=$op $cmp configs/llama3_1b_bf16_liger_compile.toml --steps "${STEPS:-50}" --warmup 10 \
          --log-freq "${LOG_FREQ:-10}" --tag "liger_torch_$op"
      done
      ;;
    allocstreams)
      p=${PREC:-fp8}
      for arm in ${ARMS:-on noopt noinput noprefetch}; do
        case $arm in
          on) sets=() ;;
          noopt) sets=(--set coda.optimizer_stream=false --set coda.step_chunk_layers=0) ;;
          noinput) sets=(--set coda.input_stream=false) ;;
          noprefetch) sets=(--set coda.prefetch_weights=false) ;;
          *) echo "allocstreams: unknown arm $arm"; continue ;;
        esac
        $cmp configs/llama3_1b_${p}_coda_compile.toml "${sets[@]}" --steps "${STEPS:-20}" --warmup 10 \
          --log-freq "${LOG_FREQ:-10}" --tag "${p}_streams_$arm"
      done
      ;;
    memsnap)
      # (the first steps' reserved peak read from the allocator's trace, scripts/probes/mem_timeline.py: one replay per
      # step in $out/memsnap_PREC_ARM/; ARMS: "coda" the compiled CODA config, "base" its compiled baseline)
      p=${PREC:-fp8}
      for arm in ${ARMS:-coda}; do
        c=configs/llama3_1b_${p}_${arm/base/baseline}_compile.toml
        CODA_TITAN_PROBE_MEMSNAP=$out/memsnap_${p}_$arm $cmp "$c" --steps "${STEPS:-4}" --warmup 2 --log-freq 1 \
          --tag "${p}_memsnap_$arm"
        python3 -c "import json,glob; [print(f, {k: round(v, 2) for k, v in json.load(open(f)).items() if k.endswith('gib')})
          for f in sorted(glob.glob('$out/memsnap_${p}_$arm/*.json'))]"
      done
      ;;
    allocexp)
      p=${PREC:-fp8}
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $cmp configs/llama3_1b_${p}_baseline_compile.toml \
        configs/llama3_1b_${p}_coda_compile.toml --steps "${STEPS:-50}" --warmup 10 --log-freq "${LOG_FREQ:-10}" \
        --tag "${p}_coda_expandable"
      ;;
    check)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_titan.py 2>&1 | tail -5 | tee "$logs/pytest_attention.txt"
      [ -n "${SKIP_CHECK_RUN:-}" ] || python3 -m coda_titan.cli train configs/llama3_1b_bf16_coda_compile.toml --training.steps 12 --metrics.log_freq 1 \
        --metrics.disable_color_printing --job.dump_folder /tmp/check > "$logs/check_coda_compile.log" 2>&1
      echo "coda_compile rc=$?"; grep -E "step: |rror|first call" "$logs/check_coda_compile.log" | sed 's/.*INFO - //' | tail -30
      ;;
    warm)
      for c in configs/llama3_1b_${PREC:-bf16}_coda_compile.toml configs/llama3_1b_${PREC:-bf16}_baseline_compile.toml; do
        python3 -m coda_titan.cli train "$c" --training.steps "${WARM_STEPS:-6}" --metrics.log_freq 1 --metrics.no-enable-wandb \
          --checkpoint.no-enable --metrics.disable_color_printing --job.dump_folder /tmp/warm > "$logs/warm_$(basename "$c" .toml).log" 2>&1
        echo "warm $(basename "$c") rc=$?"; grep -E "step: |rror" "$logs/warm_$(basename "$c" .toml).log" | sed 's/.*INFO - //' | tail -3
      done
      ;;
    compare)
      $cmp configs/llama3_1b_bf16_baseline.toml configs/llama3_1b_bf16_baseline_compile.toml \
        configs/llama3_1b_bf16_coda.toml configs/llama3_1b_bf16_coda_compile.toml --steps "${STEPS:-50}" --warmup 10
      ;;
    parity)
      # (the compiled CODA config, the one the headline recommends; PARITY_CODA=configs/llama3_1b_bf16_coda.toml: eager)
      # (PARITY_ARMS: the runs after stock eager, default "coda compiled"; "coda eager": a CODA run and stock eager's
      # repeat for the results page's pairs. Three 300-step runs take about 7.5 minutes on a warm host (on a fresh one
      # the call before is `warm`: the fifty-ninth session's parity on a fresh host stopped at 600 s in its third run);
      # PARITY_AMP=1: every run with fp32 master weights, training.dtype = float32, TorchTitan's AMP)
      # (PARITY_ARMS named: the file's tag names them, so that two calls of a day keep both files)
      # (CODA_TITAN_CE_PASS=exp in the call's environment: CODA's runs with F4 without its gradient pass, the tag
      # naming it; the stock runs do not read it)
      cfgs=(); arms=${PARITY_ARMS:+_${PARITY_ARMS// /_}}${CODA_TITAN_CE_PASS:+_ce_$CODA_TITAN_CE_PASS}
      amp=(); [ "${PARITY_AMP:-0}" = 1 ] && amp=(--set training.dtype=float32 --tag "bf16_amp$arms")
      [ "${PARITY_AMP:-0}" = 1 ] || [ -z "$arms" ] || amp=(--tag "bf16$arms")
      # (PARITY_SEED=N: every run from the init weights of seed N, --set debug.seed=N, the tag naming it: another
      # sample of how two roundings' trajectories part, a cohort of its own on the results page)
      if [ -n "${PARITY_SEED:-}" ]; then
        amp+=(--set "debug.seed=$PARITY_SEED" --tag "bf16$([ "${PARITY_AMP:-0}" = 1 ] && echo _amp)${arms}_seed$PARITY_SEED")
      fi
      for a in ${PARITY_ARMS:-coda compiled}; do
        case $a in
          eager) cfgs+=(configs/llama3_1b_bf16_baseline.toml) ;;
          compiled) cfgs+=(configs/llama3_1b_bf16_baseline_compile.toml) ;;
          coda) cfgs+=("${PARITY_CODA:-configs/llama3_1b_bf16_coda_compile.toml}") ;;
          *) echo "PARITY_ARMS takes eager, compiled and coda"; exit 2 ;;
        esac
      done
      $cmp --loss-curve configs/llama3_1b_bf16_baseline.toml "${cfgs[@]}" --steps "${PARITY_STEPS:-300}" "${amp[@]}"
      ;;
    profile)
      $cmp --profile configs/llama3_1b_bf16_coda.toml --steps 15
      $cmp --profile configs/llama3_1b_bf16_baseline_compile.toml --steps 15
      ;;
    families)
      # the GEMM-family table of the results page in one lease: the floor (quack at its default config),
      # then one profiled step of the compiled CODA and stock configs of PRECISION (bf16 or fp8)
      floor_default
      p=${PRECISION:-bf16}
      $cmp --profile "configs/llama3_1b_${p}_coda_compile.toml" --steps 15 $keep
      $cmp --profile "configs/llama3_1b_${p}_baseline_compile.toml" --steps 15 $keep
      ;;
    sdpa)
      $cmp --attention sdpa configs/llama3_1b_bf16_baseline_compile.toml configs/llama3_1b_bf16_coda.toml \
        --steps "${STEPS:-50}" --warmup 10 --tag sdpa
      ;;
    fp8)
      $cmp configs/llama3_1b_bf16_baseline_compile.toml configs/llama3_1b_fp8_baseline_compile.toml \
        configs/llama3_1b_fp8_baseline.toml --steps "${STEPS:-50}" --warmup 10 --tag fp8
      $cmp configs/llama3_1b_fp8_baseline_compile.toml --set quantize.linear.float8.recipe_name=rowwise \
        --steps "${STEPS:-50}" --warmup 10 --tag fp8_rowwise
      ;;
    fp8check)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -k fp8 -s --tb=short -W ignore::DeprecationWarning \
        > "$logs/pytest_fp8.txt" 2>&1
      grep -E "(F2|F3|B[23] fp8.*|dW13 fp8.*|model.*):|passed|failed|^E |Error" "$logs/pytest_fp8.txt" | tail -30
      [ -n "${SKIP_CHECK_RUN:-}" ] || python3 -m coda_titan.cli train configs/llama3_1b_fp8_coda.toml --training.steps 12 --metrics.log_freq 1 \
        --metrics.disable_color_printing --job.dump_folder /tmp/check8 > "$logs/check_fp8_coda.log" 2>&1
      echo "fp8 coda rc=$?"; grep -E "step: |rror|first call|cannot take" "$logs/check_fp8_coda.log" | sed 's/.*INFO - //' | tail -30
      ;;
    pinab)
      # the data loader without its pin-memory thread (pin_memory = false), both sides, against the configs as
      # they are (PREC=fp8 (default) or bf16), 50 timed steps each: the thread walks the dataset's token-buffer
      # list in Python under the GIL every step (scripts/probes/pin_thread.py), beside the host's forward
      p=${PREC:-fp8} nopin=()
      for c in baseline_compile coda_compile; do
        v=/tmp/llama3_1b_${p}_${c}_nopin.toml
        sed 's/^pin_memory = true$/pin_memory = false/' "configs/llama3_1b_${p}_${c}.toml" > "$v"
        grep -qx "pin_memory = false" "$v" || { echo "could not derive $v" >&2; exit 2; }
        nopin+=("$v")
      done
      $cmp configs/llama3_1b_${p}_baseline_compile.toml "${nopin[0]}" configs/llama3_1b_${p}_coda_compile.toml \
        "${nopin[1]}" --steps "${STEPS:-50}" --warmup 10 --tag "pin_memory_$p"
      ;;
    inputstream)
      # [coda] input_stream (the batch's copies on their own stream: the host enqueues the next step while the GPU
      # runs this one) on both sides, measured as the configs train: a metrics line, and its .item() wait, every
      # LOG_FREQ steps (compare --log-freq; tokens/s over those windows)
      p=${PREC:-fp8}
      a=$(variant input_stream "input_stream = true") || exit 2
      b=/tmp/llama3_1b_${p}_baseline_compile_input_stream.toml
      { cat "configs/llama3_1b_${p}_baseline_compile.toml"; printf '\n[coda]\ninput_stream = true\n'; } > "$b"
      $cmp configs/llama3_1b_${p}_baseline_compile.toml "$b" configs/llama3_1b_${p}_coda_compile.toml "$a" \
        --log-freq "${LOG_FREQ:-10}" --steps "${STEPS:-50}" --warmup 10 --tag "input_stream_$p"
      ;;
    inputstreameager)
      a=$(VARIANT_OF=configs/llama3_1b_fp8_coda.toml variant no_input_stream "input_stream = false") || exit 2
      $cmp configs/llama3_1b_fp8_coda.toml "$a" --log-freq "${LOG_FREQ:-10}" --steps "${STEPS:-50}" --warmup 10 \
        --tag input_stream_fp8_eager
      ;;
    b3stages)
      # B3 (bf16) on quack's epilogue and base (CODA_TITAN_B3_C_STAGES=0) against our copy at [coda] b2_c_stages's
      # base: the kernel bench's swiglu_bwd at DIMS (default 2048 4096 8192), parts in $OUT/b3_quack and $OUT; then
      # B2 (norm_residual_bwd) at that base, as the configs run it (the 2026-11-27 table's B2 rows had quack's)
      OUT=$out/b3_quack CODA_TITAN_B3_C_STAGES=0 python3 -m scripts.bench.kernels --dims ${DIMS:-2048 4096 8192} --ops swiglu_bwd
      python3 -m scripts.bench.kernels --dims ${DIMS:-2048 4096 8192} --ops swiglu_bwd norm_residual_bwd
      ;;
    fp8bench)
      python3 -m scripts.bench.kernels --precision fp8 --dims 2048 ${BENCH_OPS:+--ops $BENCH_OPS} --at-cap "${AT_CAP:-2}" \
        2>&1 | tail -20
      ;;
    bench)
      # the bf16 kernel table (issue 18: every program against its bare GEMM) at DIMS (default 2048; one d a
      # call, since each new shape autotunes); its parts go to $OUT (python -m scripts.report --parts DIR merges them);
      # AT_CAP seconds (default 2; 0: off) each program and its bare GEMMs also back to back, at the power cap
      python3 -m scripts.bench.kernels --dims ${DIMS:-2048} ${BENCH_OPS:+--ops $BENCH_OPS} --at-cap "${AT_CAP:-2}" 2>&1 | tail -14
      ;;
    fp8compare)
      $cmp ${FP8_CONFIGS:-configs/llama3_1b_fp8_baseline_compile.toml configs/llama3_1b_fp8_coda.toml \
        configs/llama3_1b_fp8_coda_compile.toml configs/llama3_1b_bf16_coda.toml} --steps "${STEPS:-50}" --warmup 10 --tag "${TAG:-fp8_coda}"
      ;;
    fp8mlp)
      $cmp configs/llama3_1b_fp8_baseline_compile.toml configs/llama3_1b_fp8_coda.toml configs/llama3_1b_fp8_coda_compile.toml \
        --set coda.fp8_mlp_dgrad=true --steps "${STEPS:-50}" --warmup 10 --tag fp8_mlp_dgrad
      ;;
    fp8wgrad)
      ab fp8_mlp_wgrad fp8_wgrad bf16_wgrad fp8_mlp_wgrad  # (whatever the config's default)
      ;;
    fp8down)
      ab fp8_down_proj down plain fp8_down_proj fp8_out_proj  # both on against both off
      ;;
    downdgradov)
      # fp8_down_dgrad with B3's overlapped epilogues (its default on the fp8 GEMM) against the compiled CODA fp8
      # defaults, no baseline (two arms fit a short call)
      a=$(variant down_dgrad_ov "fp8_down_dgrad = true") || exit 2
      $cmp "$a" configs/llama3_1b_fp8_coda_compile.toml --steps "${STEPS:-50}" --warmup 10 --tag fp8_down_dgrad_overlap
      ;;
    fp8downdgrad)
      ab fp8_down_dgrad down_dgrad bf16_b3 fp8_down_dgrad  # B3's GEMM on e5m2 D x e4m3 W2^T
      ;;
    qdat)
      # B3 on fp8 as the transposed e5m2-only B3 (fp8_down_dgrad with fp8_mlp_da_t), with and without dW2 on
      # its e4m3 y^T (fp8_down_wgrad), against the defaults
      a=$(variant q_dat "fp8_down_dgrad = true") && b=$(variant q_dat_y "fp8_down_dgrad = true" "fp8_down_wgrad = true") || exit 2
      $cmp configs/llama3_1b_fp8_baseline_compile.toml "$a" "$b" configs/llama3_1b_fp8_coda_compile.toml \
        --steps "${STEPS:-50}" --warmup 10 --tag fp8_down_dgrad_da_t
      ;;
    cechunks)
      # probe: the LM head + CE program (F4) per token-chunk size against the full head's bare cuBLAS GEMMs
      # (CE_CHUNKS: the sizes; with 16384 the four do not fit one 600 s call)
      # (CE_ZDZ="acc rounded": each size under those CODA_TITAN_F4_ZDZ modes)
      python3 -m scripts.probes.ce_chunks --chunks ${CE_CHUNKS:-2048 4096 8192} ${CE_ZDZ:+--zdz $CE_ZDZ} 2>&1 | tail -8
      ;;
    ceab)
      # the step with [coda] ce_chunk_rows = 8192 and 16384 against the configs' 4096 (PREC=fp8 or bf16)
      arms=""
      for n in ${CE_ROWS:-8192 16384}; do
        v=/tmp/llama3_1b_${PREC:-fp8}_coda_compile_ce$n.toml
        sed "s/^ce_chunk_rows = .*/ce_chunk_rows = $n/" "configs/llama3_1b_${PREC:-fp8}_coda_compile.toml" > "$v"
        grep -qx "ce_chunk_rows = $n" "$v" || { echo "could not derive $v" >&2; exit 2; }
        arms="$arms $v"
      done
      $cmp configs/llama3_1b_${PREC:-fp8}_baseline_compile.toml $arms configs/llama3_1b_${PREC:-fp8}_coda_compile.toml \
        --steps "${STEPS:-50}" --warmup 10 --tag ce_chunk_rows_${PREC:-fp8}
      ;;
    fa4layouts)
      # probe: FA4 fwd / bwd per q/k/v layout (stock's contiguous tensors against CODA's packed slices, and q apart
      # from a k v buffer), then F3 whole against F3 on row slices of W_qkv (bf16 and fp8; new shapes autotune)
      python3 -m scripts.probes.fa4_layouts 2>&1 | tail -8
      ;;
    overlap)
      # overlapped pingpong epilogues (coda_titan/kernels/cute/overlap.py): the GPU tests (the plain kernels' bits: B3
      # on the bf16 and fp8 GEMMs, F1 and B2 with their D output), then B3 plain / overlapped at the 1B shapes
      # (config 0, outputs compared), and F1 and B2 plain / overlapped / cuBLAS (scripts/probes/overlap.py)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_norm_swiglu.py tests/test_overlap.py -k overlapped \
        -rfE --tb=short -W ignore::DeprecationWarning > "$logs/pytest_overlap.txt" 2>&1
      echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^E " "$logs/pytest_overlap.txt" | tail -8
      python3 -m scripts.probes.fp8_configs --skip b2 cublas --b3 plain_fp8 b3_t b3_t_ov b3_t_q b3_t_q_ov --configs 0
      python3 -m scripts.probes.overlap 2>&1 | tail -6
      ;;
    b3configs)
      # B3's tile configs for the defaults' B3 and its fp8-GEMM form, with the bare fp8 GEMM (CONFIGS="0 3": a subset)
      python3 -m scripts.probes.fp8_configs --skip b2 cublas --b3 ${B3:-plain_fp8 b3_t b3_t_q} ${CONFIGS:+--configs $CONFIGS}
      ;;
    tstore)
      python3 -m scripts.probes.fp8_trans_store
      ;;
    fp8transpose)
      python3 -m scripts.probes.fp8_transpose
      ;;
    ligersteps)
      # (the Liger baseline against stock over STEPS (60) steps of the debug model, eager and compiled, then the
      # bisection of its kernels: scripts/probes/liger_steps.py; needs .gpu/extra's liger-kernel wheel)
      python3 -m scripts.probes.liger_steps --steps "${STEPS:-60}"
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_liger.py -rfE --tb=short 2>&1 | tail -3
      ;;
    ropebwd)
      python3 -m scripts.probes.rope_bwd
      ;;
    b1pass)
      envab "b1_triton_${PREC:-fp8}" "b1_inductor_${PREC:-fp8}" CODA_TITAN_B1_PASS=inductor
      ;;
    cepass)
      envab "ce_triton_${PREC:-fp8}" "ce_inductor_${PREC:-fp8}" CODA_TITAN_CE_PASS=inductor
      ;;
    ceexp)
      # F4 without its gradient pass (CODA_TITAN_CE_PASS=exp, kernels/cute/ce_exp.py) against the configured F4 and
      # its pass: CODA compiled (PREC, default bf16) as configured, then with the switch (tables ce_pass_P, ce_exp_P;
      # ARMS=3: the configured run again, ce_pass2_P); STEPS (default 30), LOG_FREQ (default 10)
      p=${PREC:-bf16}
      cx() { $cmp configs/llama3_1b_${p}_coda_compile.toml --steps "${STEPS:-30}" --warmup 10 --log-freq "${LOG_FREQ:-10}" \
        --tag "$1_$p"; }
      cx ce_pass
      CODA_TITAN_CE_PASS=exp cx ce_exp
      [ "${ARMS:-2}" = 3 ] && cx ce_pass2
      ;;
    ceexpprofile)
      # one profiled step of CODA compiled (PREC, default bf16) with F4's gradient pass and without it
      # (CODA_TITAN_CE_PASS=exp), each under $out/ceexp/{pass,exp}/ (the same file name: the results page's
      # newest-profile tables never see them; archive them there)
      c=configs/llama3_1b_${PREC:-bf16}_coda_compile.toml
      $cmp --profile "$c" --steps 15 --out "$out/ceexp/pass"
      CODA_TITAN_CE_PASS=exp $cmp --profile "$c" --steps 15 --out "$out/ceexp/exp"
      ;;
    b1probe)
      probe b1probe b1_pass '"variant"'
      ;;
    foldsprobe)
      probe foldsprobe folds '"fold"'
      ;;
    cepassprobe)
      python3 -m scripts.probes.ce_pass
      ;;
    dwblocksprobe)
      python3 -m scripts.probes.fp8_dw_blocks
      ;;
    adamw8b)
      p8=${PREC8B:-fp8}
      a=$(VARIANT_OF=configs/llama3_8b_${p8}_coda.toml variant adamw8b_on "coda_adamw = true") &&
        b=$(VARIANT_OF=configs/llama3_8b_${p8}_coda.toml variant adamw8b_off "coda_adamw = false") || exit 2
      for arm in ${ARMS:-off on off2}; do
        case $arm in on*) c=$a ;; *) c=$b ;; esac  # (on, on2: with the knob; off, off2: without)
        $cmp "$c" --set compile.enable=true --steps "${STEPS:-8}" --warmup 7 --tag "${p8}_8b_adamw_$arm"
      done
      ;;
    preactprobe)
      probe preactprobe preact 'summary|bytes_apart|Error|error'
      ;;
    b3math)
      probe b3math b3_math 'summary|graphed|Error|error' 600
      ;;
    fa4accum)
      probe fa4accum fa4_accum_layout 'tiles_are|Error|error' 900
      ;;
    b1accum)
      probe b1accum b1_accum 'summary|graphed|Error|error' 700
      ;;
    lmheadfp8)
      probe lmheadfp8 lm_head_fp8 'summary|graphed|Error|error' 700
      ;;
    fp8head)
      # the fp8 LM head: the GPU tests of the programs it touches (the bf16 head's too: the CE pass and the 8-bit
      # transpose changed), then its program against the bf16 head's (and the bare GEMMs) at the cap
      CODA_BOUNDS_LOG="$out/bounds.jsonl" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lm_head_ce.py \
        tests/test_gemm.py -k "lm_head or fp8_head or transpose" -rfE --tb=short -W ignore::DeprecationWarning \
        > "$logs/pytest_gpu.txt" 2>&1
      echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^E " "$logs/pytest_gpu.txt" | tail -25 | tee "$out/pytest_gpu.txt"
      python3 -m scripts.probes.lm_head_fp8 --programs > "$logs/lm_head_fp8_programs.log" 2>&1
      echo "fp8head rc=$?"; grep -E 'summary|graphed|Error|error' "$logs/lm_head_fp8_programs.log" | cut -c1-900
      ;;
    preactparity)
      curves fp8_preact preact "fp8_preact = true" "ce_chunk_rows = 4096"
      ;;
    preactab)
      a=$(variant preact "fp8_preact = true" "ce_chunk_rows = 2048") &&
        b=$(variant preact4096 "fp8_preact = true" "ce_chunk_rows = 4096") || exit 2
      o=$(variant preactoff "fp8_preact = false" "ce_chunk_rows = 2048") || exit 2
      for arm in ${PREACT_ARMS:-off on on4096 off2 on2}; do  # (off: without fp8_preact, at 2048 rows; as before)
        case $arm in off*) c=$o ;; on4096*) c=$b ;; *) c=$a ;; esac
        armrun "$c" "preact_$arm"
      done
      ;;
    fp8headparity)
      curves fp8_lm_head fp8_lm_head "fp8_lm_head = true"
      ;;
    fp8headfwdparity)
      curves fp8_lm_head_fwd fp8_lm_head_fwd "fp8_lm_head_fwd = true"
      ;;
    fp8headdw)
      # (its GPU tests first: GPU_TESTS="fp8_forward_head" gpu_train.sh gputests fp8headdw)
      # (the configured compiled fp8 config runs fp8_lm_head_dw; its A/B is that config without it)
      b=$(variant headdwoff "fp8_lm_head_dw = false") || exit 2
      hab() { $cmp "$1" --steps "${STEPS:-30}" --warmup 10 --log-freq "${LOG_FREQ:-10}" --tag "fp8headsr_$2"; }
      hab configs/llama3_1b_fp8_coda_compile.toml dw
      hab "$b" fwd
      hab configs/llama3_1b_fp8_coda_compile.toml dw2
      hab "$b" fwd2
      ;;
    fp8headdwparity)
      curves fp8_lm_head_dw_sr fp8_lm_head_dw_sr "fp8_lm_head_fwd = true" "fp8_lm_head_dw = true"
      ;;
    fp8headdgrad)
      # (its GPU tests first: GPU_TESTS="fp8_forward_head" gpu_train.sh gputests fp8headdgrad)
      a=$(variant headdgrad "fp8_lm_head_dgrad = true") || exit 2
      for arm in ${DGRAD_ARMS:-on off on2 off2}; do
        case $arm in on*) c=$a ;; *) c=configs/llama3_1b_fp8_coda_compile.toml ;; esac
        armrun "$c" "fp8headdgrad_$arm"
      done
      ;;
    fp8headdgradparity)
      # (tag fp8_lm_head_dgrad_tx: B2 with the targets' term unrounded; fp8_lm_head_dgrad, 2026-11-30: on every code)
      curves fp8_lm_head_dgrad_tx fp8_lm_head_dgrad "fp8_lm_head_dgrad = true"
      ;;
    dgradprobe)
      python3 -m scripts.probes.lm_head_fp8 --programs-only > "$logs/lm_head_fp8_programs.log" 2>&1
      echo "dgradprobe rc=$?"; grep -E 'summary|graphed|Error|error' "$logs/lm_head_fp8_programs.log" | cut -c1-900
      ;;
    codest)
      cab() { CODA_TITAN_CE_CODES_T="$2" armrun configs/llama3_1b_fp8_coda_compile.toml "codest_$1"; }
      cab off 0; cab on 1; cab off2 0; cab on2 1
      ;;
    dwblocks)
      dab() { CODA_TITAN_DW_BLOCKS="$2" armrun configs/llama3_1b_fp8_coda_compile.toml "dwblocks_$1"; }
      dab k1 1; dab k2 2; dab k4 4; dab k1b 1; dab k2b 2
      ;;
    dwblocksparity)
      k=${DW_BLOCKS:-2}
      CODA_TITAN_DW_BLOCKS=$k curves "fp8_lm_head_dw_blocks$k" "fp8_lm_head_dw_blocks$k" "fp8_lm_head_dw = true"
      ;;
    fp8repeats)
      f8=configs/llama3_1b_fp8_baseline_compile.toml
      $cmp --loss-curve $f8 $f8 $f8 --steps "${PARITY_STEPS:-300}" --tag fp8_float8_repeats
      ;;
    bf16acc)
      # (STATE_STEPS=N: from the weights after N steps of the stock eager config and its next batch)
      # (TENSORS=1: also each layer's residual stream, attention inputs, output and their gradients: --tensors;
      # TAG: the file's tag, so that calls of one session keep their files apart)
      python3 -m scripts.probes.bf16_step_accuracy ${STATE_STEPS:+--state-steps $STATE_STEPS} ${MODELS:+--models $MODELS} \
        ${TENSORS:+--tensors} ${TAG:+--tag $TAG} > "$logs/bf16_step_accuracy.log" 2>&1
      echo "bf16acc rc=$?"; grep -E "loss|wrote|Error|error|layer|: +x" "$logs/bf16_step_accuracy.log" | cut -c1-600
      ;;
    weightdrift)
      # (WD_ARMS: the arms in order, default stock_eager stock_compiled coda_compiled stock_amp stock_eager
      # coda_compiled_ce_exp; also coda_compiled_fa4_unpacked, coda_compiled_ref_attn: the bisection's switches; WD_STEPS: the checkpoints, default "20 40"; a 40-step run takes about 70 s once the
      # host has compiled CODA's kernels, the first CODA run on a fresh host 300 s: four runs fit one call)
      # (WD_TAG: the file's tag, so that two calls of a session keep both files)
      python3 -m scripts.probes.weight_drift ${WD_ARMS:+--arms $WD_ARMS} --steps ${WD_STEPS:-20 40} ${WD_TAG:+--tag $WD_TAG} \
        > "$logs/weight_drift.log" 2>&1
      echo "weightdrift rc=$?"; grep -E "^[a-z_0-9]+: |wrote|Error|error" "$logs/weight_drift.log" | cut -c1-400
      ;;
    ceslack)
      python3 -m scripts.probes.ce_offset_slack --state-steps ${SLACK_STEPS:-0 46 300} > "$logs/ce_offset_slack.log" 2>&1
      echo "ceslack rc=$?"; grep -E "^state|wrote|Error|error" "$logs/ce_offset_slack.log" | cut -c1-400
      ;;
    adamwprobe)
      cp "$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include/ATen/native/cuda/fused_adam_utils.cuh" \
        "$logs/adamw_functor.cuh" 2>/dev/null || echo "no fused_adam_utils.cuh in this torch"
      probe adamwprobe adamw '"wd_fma"|"optimizer"|Error|error'
      ;;
    stepchunks)
      # [coda] step_chunk_layers: the compiled baseline, the compiled CODA config as configured, and with the
      # optimizer step on its stream in chunks of C layers for each C of CHUNKS (default "4 1"), PREC=fp8 or bf16
      p=${PREC:-fp8}; vs=()
      for c in ${CHUNKS:-4 1}; do
        v=$(PREC=$p variant "chunks$c" "optimizer_stream = true" "step_chunk_layers = $c") || exit 2; vs+=("$v")
      done
      $cmp configs/llama3_1b_${p}_baseline_compile.toml configs/llama3_1b_${p}_coda_compile.toml "${vs[@]}" \
        --steps "${STEPS:-50}" --warmup 10 --tag "step_chunks_$p"
      ;;
    dw2reuse)
      PREC=fp8 envab dw2_reuse dw2_recast CODA_TITAN_DW2_RECAST=1
      ;;
    mlpht)
      # dW13 on F1's e4m3 H^T (no cast of H, no bf16 H kept) against dW13 on H cast in a pass
      ab fp8_mlp_h_t h_t h_cast fp8_mlp_h_t
      ;;
    envab)
      # ENV_B="NAME=VALUE" on the compiled CODA config (PREC, default fp8), alternating without and with it, no
      # baseline: tables TAG_off, TAG_on, TAG_off2, TAG_on2 (TAG default env), STEPS (40) after 10 warm-up, LOG_FREQ (10)
      [ -n "${ENV_B:-}" ] || { echo "envab needs ENV_B=\"NAME=VALUE\"" >&2; exit 2; }
      eab() { $cmp configs/llama3_1b_${PREC:-fp8}_coda_compile.toml --steps "${STEPS:-40}" --warmup 10 \
        --log-freq "${LOG_FREQ:-10}" --tag "${TAG:-env}_$1"; }
      eab off
      (export "${ENV_B?}"; eab on)
      eab off2
      (export "${ENV_B?}"; eab on2)
      ;;
    knobab)
      # KNOB="key = value" on the compiled CODA config (PREC, default fp8) between two runs as configured, no
      # baseline: tables TAG_off, TAG_on, TAG_off2 (TAG default knob), STEPS (40) after 10 warm-up, LOG_FREQ (10)
      [ -n "${KNOB:-}" ] || { echo "knobab needs KNOB=\"key = value\"" >&2; exit 2; }
      kbase=${VARIANT_OF:-configs/llama3_1b_${PREC:-fp8}_coda_compile.toml}
      a=$(variant knob "$KNOB") || exit 2
      kab() { $cmp "$1" --steps "${STEPS:-40}" --warmup 10 --log-freq "${LOG_FREQ:-10}" --tag "${TAG:-knob}_$2"; }
      kab "$kbase" off
      kab "$a" on
      kab "$kbase" off2
      ;;
    mlphtparity)
      curves fp8_mlp_h_t h_t "fp8_mlp_h_t = true"
      ;;
    qkvwgrad)
      # dW_qkv on fp8 from F3's e4m3 H (kept instead of the bf16 H) against the bf16 dW_qkv
      ab fp8_qkv_wgrad qkv_fp8 qkv_bf16 fp8_qkv_wgrad
      ;;
    hts)
      # dW_qkv (fp8_qkv_wgrad: B1's e5m2 da, the down-projection F1's Hq^T) and dW13 (fp8_mlp_h_t: the
      # out-projection F1's Hq^T) on their producers' codes, each and both, against the configured fp8 config
      a=$(variant qkv_h_t "fp8_qkv_wgrad = true") && b=$(variant mlp_h_t "fp8_mlp_h_t = true") &&
        c=$(variant both_h_t "fp8_qkv_wgrad = true" "fp8_mlp_h_t = true") || exit 2
      $cmp configs/llama3_1b_fp8_coda_compile.toml "$a" "$b" "$c" --steps "${STEPS:-30}" --warmup 10 --tag h_t
      ;;
    outbwd)
      # fp8_out_bwd (W_o's dgrad and wgrad on one e5m2 cast of dX, the e4m3 o kept) between two runs of the
      # configured fp8 config (the second a same-settings variant: the drift between runs of one config)
      a=$(variant out_bwd "fp8_out_bwd = true") && b=$(variant configured_again "fp8_out_bwd = false") || exit 2
      $cmp configs/llama3_1b_fp8_coda_compile.toml "$a" "$b" --steps "${STEPS:-50}" --warmup 10 --tag fp8_out_bwd
      ;;
    eagerfp8)
      # the eager fp8 config with fp8_out_bwd on (its default) and off, after the GPU check of wgrad_fp8_q's eager
      # op on row-major codes (their token-major copies by inductor): the twenty-seventh session's unrun check
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gemm.py -k traced_programs -rfE --tb=short \
        -W ignore::DeprecationWarning > "$logs/pytest_eagerfp8.txt" 2>&1
      echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^E " "$logs/pytest_eagerfp8.txt" | tail -8
      b=$(VARIANT_OF=configs/llama3_1b_fp8_coda.toml variant out_bwd_off "fp8_out_bwd = false") || exit 2
      $cmp configs/llama3_1b_fp8_baseline_compile.toml configs/llama3_1b_fp8_coda.toml "$b" --steps "${STEPS:-50}" \
        --warmup 10 --tag fp8_out_bwd_eager
      ;;
    outbwdparity)
      curves fp8_out_bwd out_bwd "fp8_out_bwd = true"
      ;;
    ncu)
      # Nsight Compute on one call of each program of NCU_PROGRAMS (scripts/probes/ncu_driver.py): speed of light,
      # memory, warp states, scheduler, occupancy; the CSV of each under $out (clocks left alone, as METHOD.md asks)
      n=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      [ -n "$n" ] || { echo "ncu not found"; exit 2; }
      for p in ${NCU_PROGRAMS:-b3 f1_down f1_down_t dgrad_fp8_q}; do
        "$n" --clock-control none --nvtx --nvtx-include "measure/" --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --csv --page details \
          python3 -m scripts.probes.ncu_driver --program "$p" > "$out/ncu_$p.csv" 2> "$logs/ncu_$p.err"
        echo "ncu $p rc=$? ($(wc -l < "$out/ncu_$p.csv") lines)"; grep -E "Duration|Throughput" "$out/ncu_$p.csv" | head -6
      done
      ;;
    ncustalls)
      # where the warps of one program of NCU_PROGRAMS (default b3) wait: Nsight Compute's warp-state
      # counters (raw page) and its per-instruction SASS samples (source page), CSVs under $out
      n=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      [ -n "$n" ] || { echo "ncu not found"; exit 2; }
      for p in ${NCU_PROGRAMS:-b3}; do
        "$n" --clock-control none --nvtx --nvtx-include "measure/" -k regex:kernel_cutlass --section WarpStateStats \
          --section SourceCounters --page raw --csv python3 -m scripts.probes.ncu_driver --program "$p" \
          > "$out/ncu_raw_$p.csv" 2> "$logs/ncu_raw_$p.err"
        echo "ncu raw $p rc=$? ($(wc -l < "$out/ncu_raw_$p.csv") lines)"
        "$n" --clock-control none --nvtx --nvtx-include "measure/" -k regex:kernel_cutlass --section SourceCounters \
          --page source --print-source sass --csv python3 -m scripts.probes.ncu_driver --program "$p" \
          > "$out/ncu_sass_$p.csv" 2> "$logs/ncu_sass_$p.err"
        echo "ncu sass $p rc=$? ($(wc -l < "$out/ncu_sass_$p.csv") lines)"; tail -3 "$logs/ncu_sass_$p.err"
        gzip -f "$out/ncu_sass_$p.csv"
      done
      ;;
    htprobe)
      python3 -m scripts.probes.h_t
      ;;
    qkvdgrad)
      # fp8_dgrad (B1 casts F3's da to e5m2 with the QKV gradient site's delayed scale, B2 on fp8): its GPU
      # tests (B1 -> B2 against the reference, the traced B1 against its op), then the A/B against the defaults
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_norm_rope.py tests/test_gemm.py -rfE --tb=short \
        -k "fp8_qkv_dgrad or traced_programs" -W ignore::DeprecationWarning > "$logs/pytest_qkvdgrad.txt" 2>&1
      echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^E " "$logs/pytest_qkvdgrad.txt" | tail -8
      ab fp8_dgrad qkv_dgrad_fp8 qkv_dgrad_bf16 fp8_dgrad
      ;;
    epistages)
      # B2 with a lower base for its epilogue's C-load stages (CODA_TITAN_EPI_C_STAGES; kernels/cute/stages.py): the
      # GPU test (same bits on one tile config), then the probe (B2 of QKV and W13, bf16 and fp8, autotuned with
      # quack's base and with BASE (default 2), the pinned 256 x 128 tile with each, the bare GEMM)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_norm_residual_bwd.py -k c_stage_base -rfE --tb=short \
        -W ignore::DeprecationWarning > "$logs/pytest_epistages.txt" 2>&1
      echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^E " "$logs/pytest_epistages.txt" | tail -8
      python3 -m scripts.probes.epi_stages --base "${BASE:-2}" ${INTERLEAVE:+--interleave "$INTERLEAVE"} > "$logs/epi_stages.log" 2>&1
      echo "epistages rc=$?"; grep -E '^\{|wrote|Error' "$logs/epi_stages.log" | tail -6
      ;;
    epibase)
      # [coda] b2_c_stages = 2 (B2's epilogue C-load stage base; quack's is 4) against the configs' quack base, beside the
      # compiled baseline (PREC=fp8 (default) or bf16)
      a=$(variant b2_c2 "b2_c_stages = 2") || exit 2
      $cmp configs/llama3_1b_${PREC:-fp8}_baseline_compile.toml "$a" configs/llama3_1b_${PREC:-fp8}_coda_compile.toml \
        --steps "${STEPS:-50}" --warmup 10 --tag "b2_c_stages_${PREC:-fp8}"
      ;;
    qkvdgradprofile)
      # where fp8_dgrad's time goes (measured slower than the defaults): one profiled step of that arm, beside
      # the defaults' profile (fp8profile SKIP_BASELINE=1)
      a=$(variant qkv_dgrad "fp8_dgrad = true") || exit 2
      $cmp --profile "$a" --steps 15 $keep
      ;;
    t8probe)
      python3 -m scripts.probes.transpose_8bit
      ;;
    t8ab)
      # fp8_qkv_wgrad with transpose_8bit's token-major copy of B1's codes against the configured fp8 config
      # (its arm's 2.8 ms loss was inductor's 0.347 ms copy a layer: the twenty-eighth session's htprofile)
      a=$(variant qkv_wgrad_t8 "fp8_qkv_wgrad = true") || exit 2
      $cmp configs/llama3_1b_fp8_coda_compile.toml "$a" --steps "${STEPS:-30}" --warmup 10 --tag qkv_wgrad_t8
      ;;
    t8mem)
      # the fp8 defaults' dW_o operands copied token-major by transpose_8bit (as configured) and by inductor's
      # .t().contiguous() (CODA_TITAN_T8=inductor): reserved and live peaks, step time; no baseline
      $cmp configs/llama3_1b_fp8_coda_compile.toml --steps "${STEPS:-30}" --warmup 10 --tag t8_triton
      CODA_TITAN_T8=inductor $cmp configs/llama3_1b_fp8_coda_compile.toml --steps "${STEPS:-30}" --warmup 10 --tag t8_inductor
      ;;
    lmheaddw)
      # the LM head's dW at the 1B shape: CODA's chunks (quack, fp32 sum) against cuBLAS chunks and one GEMM,
      # on cross-entropy-like and random operands (scripts/probes/lm_head_dw.py)
      python3 -m scripts.probes.lm_head_dw ${CUBLAS_ONLY:+--cublas-only} ${AT_CAP:+--at-cap "$AT_CAP"}
      ;;
    lcescaledexp)
      # probe: the LM head with its gradients, CODA's program against quack's chunked and scaled-exp linear-CE
      # pipelines (scripts/probes/lce_scaled_exp.py: what the design in docs/fp8.md would buy)
      python3 -m scripts.probes.lce_scaled_exp
      ;;
    t8env)
      # CODA fp8 compiled under CODA_TITAN_T8=$T8 (inductor | triton; default inductor), after fp8compare in the same call
      CODA_TITAN_T8=${T8:-inductor} $cmp configs/llama3_1b_fp8_coda_compile.toml --steps "${STEPS:-50}" --warmup 10 \
        --tag "t8_${T8:-inductor}_env"
      ;;
    t8parity)
      # 300-step loss curves of float8 + compile and fp8_qkv_wgrad (B1's codes through transpose_8bit), no
      # configured arm (it does not fit the call beside them; earlier sessions' curves hold it)
      a=$(variant qkv_wgrad_t8 "fp8_qkv_wgrad = true") || exit 2
      $cmp --loss-curve configs/llama3_1b_fp8_baseline_compile.toml "$a" --steps "${PARITY_STEPS:-300}" --tag qkv_wgrad_t8
      ;;
    htprofile)
      # where fp8_qkv_wgrad's 2.8 ms go (measured slower, its kernels faster: probe_h_t_…json): one profiled step
      # of the fp8 defaults and of that arm, in one lease (the GEMM families and top kernels side by side)
      a=$(variant qkv_h_t "fp8_qkv_wgrad = true") || exit 2
      $cmp --profile configs/llama3_1b_fp8_coda_compile.toml --steps 15 $keep
      $cmp --profile "$a" --steps 15 $keep
      ;;
    qkvwgradparity)
      curves fp8_qkv_wgrad qkv_fp8 "fp8_qkv_wgrad = true"
      ;;
    qkvwgradcause)
      # fp8_qkv_wgrad's parity miss (mean abs. 0.80% against the configured arm's 0.48%): the same dW_qkv on fp8
      # with its gradient cast at the current amax (torchao's recipe: fp8_dgrad off, so B1 writes no delayed codes);
      # near the configured arm's curve, B1's delayed e5m2 codes were the cause; near 0.80%, fp8 dW_qkv itself
      curves fp8_qkv_wgrad_current qkv_fp8_current "fp8_qkv_wgrad = true" "fp8_dgrad = false"
      ;;
    qkvdgradparity)
      curves fp8_dgrad qkv_dgrad "fp8_dgrad = true"
      ;;
    actmargin)
      # 300-step loss curves: float8 + compile, CODA fp8 eager as configured (fp8_act_margin = 1 since the
      # seventeenth session), and with [coda] fp8_act_margin = 0; each run's train.log ends with the clamp counts
      v=$(VARIANT_OF=configs/llama3_1b_fp8_coda.toml variant act0 "fp8_act_margin = 0") || exit 2
      $cmp --loss-curve configs/llama3_1b_fp8_baseline_compile.toml configs/llama3_1b_fp8_coda.toml "$v" \
        --steps "${PARITY_STEPS:-300}" --tag fp8_act_margin
      grep -H "clamped" /tmp/compare/*/train.log | tee "$out/clamped.txt"
      ;;
    fp8sites)
      # which fp8 sites move CODA fp8's loss below float8 + compile's (docs/fp8.md, parity): 300-step curves of
      # float8 + compile and of the eager CODA fp8 config with its backward in bf16, and with W2's and W_o's inputs in bf16
      # SITES picks the arms (default both; the three curves do not fit one 600 s call, one arm with float8 does)
      arms=() sites=${SITES:-bwd fwd}
      for s in $sites; do
        case $s in
          bwd) v=$(VARIANT_OF=configs/llama3_1b_fp8_coda.toml variant bwd_bf16 "fp8_mlp_dgrad = false" "fp8_mlp_wgrad = false") ;;
          fwd) v=$(VARIANT_OF=configs/llama3_1b_fp8_coda.toml variant fwd_in_bf16 "fp8_down_proj = false" "fp8_out_proj = false") ;;
          *) echo "fp8sites: SITES takes bwd and fwd, not '$s'" >&2; exit 2 ;;
        esac || exit 2
        arms+=("$v")
      done
      $cmp --loss-curve configs/llama3_1b_fp8_baseline_compile.toml "${arms[@]}" --steps "${PARITY_STEPS:-300}" \
        --tag "fp8_sites_${sites// /_}"
      ;;
    qdatparity)
      curves fp8_down_dgrad_da_t q_dat_y "fp8_down_dgrad = true" "fp8_down_wgrad = true"
      ;;
    fp8layerwgrads)
      ab fp8_layer_wgrads layer_wgrads bf16_wgrads fp8_layer_wgrads  # dW_qkv, dW_o, dW2 on fp8 (torchao's recipe)
      ;;
    tracepasses)
      # [coda] trace_passes on / off (B1 and the plain GEMMs traced into the compiled graph or opaque ops), fp8 and bf16
      ab trace_passes_fp8 traced opaque trace_passes
      PREC=bf16 ab trace_passes_bf16 traced opaque trace_passes
      ;;
    fp8downs)
      # the F1 input sites on fp8 again, now that their weight passes are prefetched too: float8 + compile, CODA fp8
      # compiled as configured, with fp8_down_proj, with fp8_down_proj and fp8_out_proj
      a=$(variant down "fp8_down_proj = true") && b=$(variant down_out "fp8_down_proj = true" "fp8_out_proj = true") || exit 2
      $cmp configs/llama3_1b_fp8_baseline_compile.toml configs/llama3_1b_fp8_coda_compile.toml "$a" "$b" \
        --steps "${STEPS:-50}" --warmup 10 --tag fp8_down_proj_sites
      ;;
    graphs)
      # [coda] cuda_graphs: the compiled CODA fp8 config (PREC=bf16: bf16) as configured, with its blocks replayed as
      # CUDA graphs, and (fp8) with both F1 input sites on fp8 as well (host-bound without graphs), against the
      # compiled baseline
      p=${PREC:-fp8}
      a=$(variant graphs "cuda_graphs = true") || exit 2
      b=""; [ "$p" = fp8 ] && { b=$(variant graphs_down_out "cuda_graphs = true" "fp8_down_proj = true" "fp8_out_proj = true") || exit 2; }
      $cmp configs/llama3_1b_${p}_baseline_compile.toml configs/llama3_1b_${p}_coda_compile.toml "$a" $b \
        --steps "${STEPS:-50}" --warmup 10 --tag cuda_graphs_$p
      ;;
    downout)
      # both F1 input sites on fp8 without CUDA graphs, against float8 + compile (the graphs phase's missing arm)
      a=$(variant down_out "fp8_down_proj = true" "fp8_out_proj = true") || exit 2
      $cmp configs/llama3_1b_fp8_baseline_compile.toml "$a" --steps "${STEPS:-50}" --warmup 10 --tag fp8_down_out
      ;;
    downoutparity)
      curves fp8_down_out down_out "fp8_down_proj = true" "fp8_out_proj = true"  # both F1 input sites
      ;;
    e5m2wgrad)
      # dW13 on B3's e5m2 da (B3 writes no bf16 da) against dW13 on the bf16 da cast again
      ab fp8_mlp_wgrad_e5m2 e5m2_da bf16_da fp8_mlp_wgrad_e5m2
      ;;
    e5m2wgradparity)
      curves fp8_mlp_wgrad_e5m2 e5m2_da "fp8_mlp_wgrad_e5m2 = true"
      ;;
    downwgrad)
      # dW2 on fp8 from B3's e4m3 y against the bf16 dW2
      ab fp8_down_wgrad y_e4m3 y_bf16 fp8_down_wgrad
      ;;
    downwgradparity)
      curves fp8_down_wgrad y_e4m3 "fp8_down_wgrad = true"
      ;;
    datdownparity)
      curves fp8_mlp_da_t_down_wgrad da_y_t "fp8_mlp_da_t = true" "fp8_down_wgrad = true"
      ;;
    dat)
      # dW13 on the da^T B3 writes itself (M-major e5m2 stores) against dW13 on its copy pass
      ab fp8_mlp_da_t da_t da_copy fp8_mlp_da_t
      ;;
    datdown)
      a=$(variant da_y_t "fp8_down_wgrad = true" "fp8_mlp_da_t = true") &&
        b=$(variant da_y_copy "fp8_down_wgrad = true" "fp8_mlp_da_t = false") || exit 2
      $cmp configs/llama3_1b_fp8_baseline_compile.toml "$a" "$b" --steps "${STEPS:-50}" --warmup 10 --tag fp8_mlp_da_t_down_wgrad
      ;;
    fusedclip)
      # the clip's scale inside fused AdamW (grad_scale) against TorchTitan's clip pass
      ab "fused_clip_${PREC:-fp8}" clip_fused clip_pass fused_clip
      ;;
    fusedclipparity)
      curves fused_clip clip_fused "fused_clip = true"
      ;;
    optstreambf16)
      # [coda] optimizer_stream on / off on the compiled CODA bf16 config, against stock + compile
      PREC=bf16 ab optimizer_stream_bf16 opt_stream main_stream optimizer_stream
      ;;
    optstream)
      # [coda] optimizer_stream on / off (the optimizer step on its own stream: the batch copy's synchronization
      # waits for the backward only, and the host enqueues the next forward beside the step), after its GPU test
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_opt_stream.py -rfE --tb=short -W ignore::DeprecationWarning \
        > "$logs/pytest_optstream.txt" 2>&1
      echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^E " "$logs/pytest_optstream.txt" | tail -8
      ab optimizer_stream opt_stream main_stream optimizer_stream
      ;;
    prefetch)
      # [coda] prefetch_weights on / off: the fp8 weight pass issued at the optimizer step on a side stream, or at
      # the forward's start (where the host, just synchronized by the batch copy, leaves the GPU idle)
      ab prefetch_weights prefetch own_pass prefetch_weights
      ;;
    fp8downdgradparity)
      curves fp8_down_dgrad down_dgrad "fp8_down_dgrad = true"
      ;;
    fp8downprofile)
      # where the fp8_down_proj + fp8_out_proj arm's time goes: one profiled step of it (the plain arm is
      # the families phase's CODA fp8 profile)
      a=$(variant down "fp8_down_proj = true" "fp8_out_proj = true") || exit 2
      $cmp --profile "$a" --steps 15 $keep
      ;;
    fp8store)
      # issue 19's first experiment: F2 writing y as e4m3 from its epilogue on SM90 (scripts/probes/fp8_gated_store.py)
      python3 -m scripts.probes.fp8_gated_store > "$logs/fp8store.log" 2>&1
      echo "fp8store rc=$?"; grep -E '^\{|wrote|Error' "$logs/fp8store.log" | tail -6
      ;;
    fp8model)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_model.py -k whole_1b_fp8 -s --tb=short -W ignore::DeprecationWarning 2>&1 \
        | grep -E "^\.*model:|passed|failed|^E " | tail -8
      ;;
    fp8parity|fp8paritydefaults)
      # fp8paritydefaults: without the float8-eager arm (the slowest run), so that it fits one call
      eager=configs/llama3_1b_fp8_baseline.toml tag=fp8
      [ "$phase" = fp8parity ] || eager="" tag=fp8_defaults
      $cmp --loss-curve configs/llama3_1b_fp8_baseline_compile.toml configs/llama3_1b_fp8_coda.toml $eager \
        --steps "${PARITY_STEPS:-300}" --tag $tag
      ;;
    fp8profile)
      # (LOG_FREQ=10: the steps before the profiled one log, and so wait for the GPU, as the configs train)
      [ -n "${SKIP_BASELINE:-}" ] || $cmp --profile configs/llama3_1b_fp8_baseline_compile.toml --steps 15 $keep \
        --log-freq "${LOG_FREQ:-1}"
      $cmp --profile configs/llama3_1b_fp8_coda_compile.toml --steps 15 $keep --log-freq "${LOG_FREQ:-1}"
      ;;
    hostoverhead)
      # probe: the host time of one call of each program (bf16 and fp8, d = 2048) beside its GPU time
      python3 -m scripts.probes.host_overhead > "$logs/host_overhead.log" 2>&1
      echo "hostoverhead rc=$?"; tail -4 "$logs/host_overhead.log"
      ;;
    phases)
      # probe: the host's time per step, phase by phase (data, copies, forward, backward, optimizer, the wait for
      # the GPU, logging), and which phase grows in the slow steps (CONFIGS, default the two compiled CODA configs)
      python3 -m scripts.probes.step_phases ${CONFIGS:-configs/llama3_1b_fp8_coda_compile.toml \
        configs/llama3_1b_bf16_coda_compile.toml} --steps "${STEPS:-50}" --warmup 10 ${TAG:+--tag "$TAG"} \
        --workdir /tmp/compare 2>&1 | tail -4
      ;;
    lmheadscale)
      python3 -m scripts.probes.lm_head_scale 2>&1 | tail -3
      ;;
    qgrad)
      python3 -m pytest -q -m gpu tests/test_gemm.py -k "quantize or transpose_8bit" 2>&1 | tail -3
      python3 -m scripts.probes.quantize_grad 2>&1 | tail -3
      ;;
    qgradab)
      # CODA fp8 compiled with quantize_grad's Triton passes (the default) against the previous kernels
      # (CODA_TITAN_CAST_PASS=inductor), logging every LOG_FREQ steps (tables qgrad_triton, qgrad_inductor)
      LOG_FREQ=${LOG_FREQ:-10} envab qgrad_triton qgrad_inductor CODA_TITAN_CAST_PASS=inductor
      ;;
    pkgab)
      # CODA compiled (PREC, default fp8) with the package of an earlier commit (.gpu/base.tgz, made here before the
      # call by `git archive BASE coda_titan | gzip`; carried), run from a copy of this checkout whose coda_titan is
      # that one (a training process imports coda_titan from its working directory first), then as this checkout
      # runs it, then (ENV_B="NAME=VALUE", where given) this checkout with that switch, then the earlier package
      # again: tables TAG_base, TAG_new, TAG_env, TAG_base2 (TAG default pkg); LOG_FREQ (default 10), STEPS (40)
      [ -f .gpu/base.tgz ] || { echo "pkgab needs .gpu/base.tgz (git archive BASE coda_titan | gzip)" >&2; exit 2; }
      rm -rf /tmp/basetree && mkdir -p /tmp/basetree && cp -r scripts configs /tmp/basetree/ \
        && tar xzf .gpu/base.tgz -C /tmp/basetree || exit 2
      pab() { python3 -m scripts.compare --out "$out" --workdir /tmp/compare \
        configs/llama3_1b_${PREC:-fp8}_coda_compile.toml --steps "${STEPS:-40}" --warmup 10 \
        --log-freq "${LOG_FREQ:-10}" --tag "${TAG:-pkg}_$1"; }
      (cd /tmp/basetree && pab base)
      pab new
      [ -z "${ENV_B:-}" ] || (export "${ENV_B?}"; pab env)
      (cd /tmp/basetree && pab base2)
      ;;
    hostlayers)
      python3 -m scripts.probes.host_layers --precision ${PREC:-fp8 bf16} 2>&1 | tail -40
      ;;
    oplayers)
      python3 -m scripts.probes.op_layers 2>&1 | tail -20
      ;;
    hostslack)
      # probe: host-bound GPU idle of the forward, without a profiler: the step with a GPU sleep of S ms at each
      # forward's start against none (SLEEPS, default "0 30"; CONFIG; GRAPHS=1 / OPTSTREAM=1 add an arm with
      # cuda_graphs / optimizer_stream; SET="key=value,..." one more arm with those overrides; SYNC_DEBUG=1: each
      # forward counts the synchronizing calls in it, by source; LOG_FREQ=10: a metrics line every 10 steps as the
      # configs log, the forwards after a logged step apart from the rest),
      # and cProfile's split of the host time of the no-sleep arm's last forward
      python3 -m scripts.probes.host_slack --config "${CONFIG:-configs/llama3_1b_fp8_coda_compile.toml}" \
        --steps "${STEPS:-30}" --cprofile-forward "${STEPS:-30}" --sleep-ms ${SLEEPS:-0 30} ${GRAPHS:+--set coda.cuda_graphs=true} \
        ${OPTSTREAM:+--set coda.optimizer_stream=true} ${SET:+--set "$SET"} ${SYNC_DEBUG:+--sync-debug} \
        --log-freq "${LOG_FREQ:-1}" --workdir /tmp/compare 2>&1 | tail -12
      ;;
    hostprofile)
      python3 -m scripts.probes.host_profile > "$logs/host_profile.log" 2>&1
      echo "hostprofile rc=$?"; tail -3 "$logs/host_profile.log" | cut -c1-600
      ;;
    profile8b)
      # one profiled step of the 8B bf16 pair on one GPU, compile and full AC on (as in fsdp2's 8B runs):
      # where CODA's 8B step loses to stock's (GEMM families; AC's recompute inside the step)
      for c in configs/llama3_8b_bf16_baseline.toml configs/llama3_8b_bf16_coda.toml; do
        $cmp --profile "$c" --set compile.enable=true --steps 10 $keep
      done
      ;;
    8b)
      # (COMPILE=1: both with torch.compile, tag 8b_compile)
      $cmp configs/llama3_8b_bf16_baseline.toml configs/llama3_8b_bf16_coda.toml --steps 8 --warmup 7 \
        ${COMPILE:+--set compile.enable=true} --tag "8b${COMPILE:+_compile}"
      ;;
    sustained)
      # probe: B3, F2 and B2 of W13 (bf16, 1B shapes) on pinned tile configs, a short burst against calls back to back
      # at the power cap (scripts/probes/sustained.py; SECONDS_PER_ARM, ROUNDS)
      python3 -m scripts.probes.sustained --seconds "${SECONDS_PER_ARM:-2}" --rounds "${ROUNDS:-2}" \
        ${PROGRAMS:+--programs $PROGRAMS} ${TILES:+--configs $TILES} 2>&1 | tail -40
      ;;
    b3ab8b)
      # B3 (bf16) at the 8B shapes in the step, both compiled: CODA with B3 on quack's epilogue and base
      # (CODA_TITAN_B3_C_STAGES=0), then the 8B pair as configured (B3 at [coda] b2_c_stages's base)
      CODA_TITAN_B3_C_STAGES=0 $cmp configs/llama3_8b_bf16_coda.toml --steps 8 --warmup 7 --set compile.enable=true \
        --tag 8b_compile_b3_quack
      $cmp configs/llama3_8b_bf16_baseline.toml configs/llama3_8b_bf16_coda.toml --steps 8 --warmup 7 \
        --set compile.enable=true --tag 8b_compile
      ;;
    fp88bmem)
      # the 8B fp8 CODA config without the weight pass's transposed e4m3 weights (fp8_mlp_dgrad, fp8_dgrad and
      # fp8_out_bwd off): how much of its peak over float8 + compile's those hold (after fp88b in the same lease)
      v=$(VARIANT_OF=configs/llama3_8b_fp8_coda.toml variant no_wt "fp8_mlp_dgrad = false" "fp8_dgrad = false" \
        "fp8_out_bwd = false") || exit 2
      $cmp "$v" --set compile.enable=true --steps "${STEPS:-8}" --warmup 7 --tag fp8_8b_no_wt
      ;;
    weighttbwd)
      # [coda] fp8_weight_t_bwd: the 8B CODA fp8 config with it (reserved / live peak and step against fp88b's)
      v=$(VARIANT_OF=configs/llama3_8b_fp8_coda.toml variant wtbwd "fp8_weight_t_bwd = true") || exit 2
      $cmp "$v" --set compile.enable=true --steps "${STEPS:-8}" --warmup 7 --tag fp8_8b_weight_t_bwd
      ;;
    fp88b)
      # issue 19: does 8B fp8 fit one GPU (full AC), and its tokens/s against float8 + compile at 8B
      $cmp configs/llama3_8b_fp8_baseline.toml configs/llama3_8b_fp8_coda.toml --set compile.enable=true \
        --steps "${STEPS:-8}" --warmup 7 --tag fp8_8b
      ;;
    hold)
      # (a check of CALL_LIMIT: one child process that waits HOLD_S seconds, default 60, and nothing else)
      sleep "${HOLD_S:-60}"
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  echo "=== $phase done in $((SECONDS - t0)) s"
done

