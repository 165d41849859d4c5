"""The torch attention paths equal plain per-token attention, however they pad, loop or group sequences."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import reference


def naive_prefill(query, key_cache, value_cache, tables, starts, lens, scale):  # type: ignore[no-untyped-def]
    """Token by token: softmax(q·k) over every position up to the token's own, GQA by repeating heads."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for s, length in enumerate(lens):
        slots = [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(length)]
        keys = key_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        values = value_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        num_queries = starts[s + 1] - starts[s]
        for j in range(num_queries):
            position = length - num_queries + j
            scores = torch.einsum("hd,lhd->hl", query[starts[s] + j], keys[: position + 1]) * scale
            out[starts[s] + j] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values[: position + 1])
    return out


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "causal_groups"),
    [([5, 6, 5], [10, 12, 14], [False]),  # similar sizes: one padded batch
     ([1, 40, 2], [3, 40, 70], [False, True, False]),  # skewed: a loop over sequences; the second is a whole prompt
     ([7, 7, 7], [7, 7, 7], [True]),  # whole prompts: SDPA's causal path, no mask
     ([5, 6, 5], [5, 6, 5], [True]),  # whole prompts of different lengths, padded to the longest
     ([5, 6, 5], [5, 6, 9], [False]),  # one has context before its new tokens: the mask
     ([1, 40, 3], [1, 40, 70], [True, True, False])],  # a loop: two whole prompts, one after its context
)
def test_prefill_reference_matches_naive_attention(query_lens: list[int], context_lens: list[int],
                                                   causal_groups: list[bool]) -> None:
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, dim = 8, 32, 6, 2, 16
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    tables = torch.randperm(num_blocks)[: 3 * 9].view(3, 9).to(torch.int32)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], heads, dim)
    starts_tensor, lens = torch.tensor(starts, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32)
    plan = reference.plan_prefill(query, key_cache, value_cache, tables, starts_tensor, lens)
    assert [group.mask is None for group in plan.groups] == causal_groups
    out = reference.paged_prefill_attention(query, key_cache, value_cache, tables, starts_tensor, lens, 0.25)
    expected = naive_prefill(query, key_cache, value_cache, tables, starts, context_lens, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context_lens", [[9, 10, 11, 12], [70, 3, 1, 40, 2, 66, 17]])
def test_decode_reference_matches_naive_attention_whatever_the_length_groups(context_lens: list[int]) -> None:
    torch.manual_seed(1)
    block_size, num_blocks, heads, kv_heads, dim = 8, 80, 6, 2, 16
    num_seqs = len(context_lens)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    tables = torch.randperm(num_blocks)[: num_seqs * 9].view(num_seqs, 9).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    query = torch.randn(num_seqs, heads, dim)
    plan = reference.plan_decode(query, key_cache, value_cache, tables, lens)
    assert len(plan.groups) == (1 if max(context_lens) < 2 * min(context_lens) else reference.MAX_DECODE_GROUPS)
    out = reference.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.25, plan=plan)
    expected = naive_prefill(query, key_cache, value_cache, tables, list(range(num_seqs + 1)), context_lens, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("has_amx", [True, False])
def test_bf16_decode_runs_in_bf16_only_where_the_cpu_has_amx_and_stays_close_to_fp32(
    has_amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reference, "has_amx_for", lambda dtype: has_amx and dtype == torch.bfloat16)
    assert reference._math_dtype(torch.bfloat16, torch.device("cpu")) == (
        torch.bfloat16 if has_amx else torch.float32)
    assert reference._math_dtype(torch.float16, torch.device("cpu")) == torch.float32
    assert reference._math_dtype(torch.bfloat16, torch.device("meta")) == torch.float32  # never on a GPU
    torch.manual_seed(2)
    block_size, num_blocks, heads, kv_heads, dim = 8, 80, 6, 2, 16
    context_lens = [70, 3, 40, 17]
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim).bfloat16()
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim).bfloat16()
    tables = torch.randperm(num_blocks)[: 4 * 9].view(4, 9).to(torch.int32)
    query = torch.randn(4, heads, dim).bfloat16()
    out = reference.paged_attention_decode(query, key_cache, value_cache, tables,
                                           torch.tensor(context_lens, dtype=torch.int32), 0.25)
    expected = naive_prefill(query.float(), key_cache.float(), value_cache.float(), tables, list(range(5)),
                             context_lens, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)  # bf16 rounding of the output
