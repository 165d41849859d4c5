"""The CPU's fused layer ops (rotary in place, residual add + RMS norm, SiLU(gate) * up) compute what the plain
torch layers do, and the engine uses them exactly where it should: the ``cpu`` backend, numerics other than
``exact``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.models.llama import LlamaMLP, RMSNorm
from engine.models.rotary import apply_rotary
from paged_kernels.cpu_extension import cpu_kernels


@pytest.fixture(scope="module")
def fused_ops():  # type: ignore[no-untyped-def]
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here (a C++ compiler and ninja are installed)"
    return kernels


# a reduced-precision result is the fp32 one rounded once: within one unit in its last place (fp32 sums in
# another order can tip a rounding to the other side)
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}
DTYPES = list(TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim"), [(1, 9, 3, 64), (13, 4, 2, 32), (40, 2, 1, 128)])
def test_fused_rotary_equals_apply_rotary_on_views_of_the_qkv_rows(
    fused_ops, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,  # type: ignore[no-untyped-def]
) -> None:
    torch.manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    expected_q, expected_k = apply_rotary(q.float(), k.float(), (cos, sin))  # in fp32, then rounded once
    untouched = qkv[:, (heads + kv_heads) * head_dim:].clone()
    fused_ops.rotary_(q, k, cos, sin)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(q, expected_q.to(dtype), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k, expected_k.to(dtype), atol=tolerance, rtol=tolerance)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], untouched)  # the values' columns stay


def test_fused_ops_refuse_mixed_dtypes(fused_ops) -> None:  # type: ignore[no-untyped-def]
    q, k = torch.randn(2, 2, 8, dtype=torch.bfloat16), torch.randn(2, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cos/sin must be fp32"):
        fused_ops.rotary_(q, k, torch.ones(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="share a dtype"):
        fused_ops.add_rms_norm_(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_fused_norm_equals_the_plain_norm_and_adds_the_residual_in_place(
    fused_ops, rows: int, with_residual: bool, dtype: torch.dtype,  # type: ignore[no-untyped-def]
) -> None:
    torch.manual_seed(1)
    plain, fused = RMSNorm(576, 1e-5), RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.weight.copy_(plain.weight.to(dtype))  # the same weights in both
        fused.weight.copy_(plain.weight)
    fused.fused_ops = fused_ops
    hidden = (torch.randn(rows, 576) * 3).to(dtype)
    residual = torch.randn(rows, 576).to(dtype) if with_residual else None
    with torch.inference_mode():  # the plain norm in fp32 from the rounded sum, rounded once: what fused computes
        expected_sum = hidden.float() if residual is None else (residual + hidden).float()
        expected, _ = plain(expected_sum.clone())
        owned = None if residual is None else residual.clone()
        normed, summed = fused(hidden.clone() if residual is None else hidden, owned)
    tolerance = max(TOLERANCE[dtype], 1e-5)
    assert normed.dtype == summed.dtype == dtype
    torch.testing.assert_close(normed, expected.to(dtype), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(summed, expected_sum.to(dtype), atol=1e-6, rtol=1e-6)
    if owned is not None:
        assert summed is owned  # the residual stream was summed in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "size"), [(1, 1536), (7, 100), (33, 8)])
def test_fused_silu_and_mul_equals_silu_of_the_gate_times_up(
    fused_ops, rows: int, size: int, dtype: torch.dtype,  # type: ignore[no-untyped-def]
) -> None:
    torch.manual_seed(2)
    gate_up = (torch.randn(rows, 2 * size) * 6).to(dtype)  # gates far into both tails of the sigmoid
    extremes = [0.0, -100.0, 100.0, -1e4, float("inf"), float("-inf"), float("nan")]  # e^100 overflows a naive sigmoid
    if dtype != torch.float16:  # past fp16's range
        extremes += [-1e33, -3e38]  # far below e^x's underflow: SiLU is -0, not gate * e^-87
    gate_up[0, : min(len(extremes), size)] = torch.tensor(extremes[:size])
    gate, up = gate_up.float().split(size, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).to(dtype)  # in fp32, then rounded once
    tolerance = max(TOLERANCE[dtype], 1e-5)
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), expected, atol=tolerance, rtol=tolerance,
                               equal_nan=True)
    rows_at_a_stride = torch.cat([gate_up, gate_up], dim=-1)[:, : 2 * size]  # the gate_up columns of wider rows
    torch.testing.assert_close(fused_ops.silu_and_mul(rows_at_a_stride), expected, atol=tolerance, rtol=tolerance,
                               equal_nan=True)


@pytest.mark.parametrize("gate_up", [torch.randn(3, 7), torch.randn(8, 4).t(), torch.randn(2, 3, 4)],
                         ids=["odd width", "strided columns", "three dims"])
def test_fused_silu_and_mul_refuses_rows_it_cannot_split(fused_ops, gate_up: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match=r"gate_up must be \[tokens, 2 \* intermediate\]"):
        fused_ops.silu_and_mul(gate_up)


def test_fused_silu_and_mul_refuses_a_tensor_off_the_cpu(fused_ops) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="gate_up must be on the CPU"):
        fused_ops.silu_and_mul(torch.empty(2, 8, device="meta"))


def _fused(llm: LLM) -> bool:
    fusable = [m for m in llm.engine.model.modules() if isinstance(m, RMSNorm | LlamaMLP)]
    flags = {m.fused_ops is not None for m in fusable}
    assert len(flags) == 1, "some layers fused and others not"
    return flags.pop()


@pytest.mark.parametrize(("kwargs", "fused"), [
    ({}, True),  # the defaults: cpu backend, auto numerics
    ({"cpu_weight_packing": "exact"}, False),  # token-exact with transformers: the plain layers
    ({"attention_backend": "torch"}, False),  # the plain-torch backend compiles nothing
    ({"dtype": "bfloat16"}, True),  # bf16 rows too
    ({"dtype": "bfloat16", "cpu_weight_packing": "exact"}, False),
])
def test_the_engine_fuses_layer_ops_only_where_they_hold(
    tiny_model_dir: Path, kwargs: dict[str, str], fused: bool, fused_ops,  # type: ignore[no-untyped-def]
) -> None:
    llm = LLM(model=str(tiny_model_dir), **{"dtype": "float32", "kv_cache_memory": "4MiB", "device": "cpu", **kwargs})
    assert _fused(llm) is fused


def test_fused_and_plain_layers_give_the_same_greedy_text(tiny_model_dir: Path, fused_ops) -> None:  # type: ignore[no-untyped-def]
    from engine import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["Hello, my name is", "The capital of France", "1 2 3 4"]
    outputs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", attention_backend=backend,
                  device="cpu", kv_cache_dtype="float32")  # one cache dtype: the layers are what differs
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["cpu"] == outputs["torch"]
