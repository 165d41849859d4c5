"""Run by test_kernels_under_asan.py in a process with AddressSanitizer's runtime preloaded: the CPU's kernels, built
with ``-fsanitize=address``: the linear layers over shapes off their blocks and row counts across their passes, decode
attention over contexts whole and split across threads, the KV cache write over strided rows, and the sampler over
vocabularies off its blocks; each result checked
against fp64 (the cache write against a copy row by row). A read or write outside a tensor aborts the process with
ASan's report; a wrong value fails an assertion."""

from __future__ import annotations

import torch

from paged_kernels.cpu_extension import SOURCES, build_kernels

SHAPES = [(1, 1), (1, 2), (5, 37), (31, 3), (33, 5), (65, 8), (67, 100), (97, 33), (130, 70)]
ROWS = [0, 1, 2, 3, 5, 6, 7, 12, 13, 19]
# decode: (context lengths, block size, query heads, KV heads, head_dim, threads); one or three sequences on two or
# four threads split their contexts of 256 positions or more into parts
DECODE_CASES = [([1], 16, 9, 3, 64, 2), ([300], 16, 9, 3, 64, 2), ([517, 3, 260], 8, 8, 2, 36, 4),
                ([1000], 1, 4, 4, 80, 4), ([40, 7], 4, 6, 1, 40, 2)]


def close(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> bool:
    return bool(((got.double() - expected).abs() <= expected.abs() * rtol + atol).all())


def main() -> None:
    kernels = build_kernels("pagedserve_cpu_kernels_asan_test", [source.read_text() for source in SOURCES],
                            sanitizer="address")
    torch.manual_seed(0)
    checked = 0
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features).bfloat16()
        qdata = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
        scale = torch.rand(out_features, -(-in_features // 32)) / 100
        dequantized = qdata.double() * scale.double().repeat_interleave(32, dim=1)[:, :in_features]
        bias = torch.randn(out_features)
        packs = [("int8_linear", kernels.int8_pack_weight(qdata, scale))]
        if kernels.has_int8_vnni_linear():
            packs.append(("int8_vnni_linear", kernels.int8_vnni_pack_weight(qdata, scale)))
        bf16_packed = kernels.bf16_pack_weight(weight) if kernels.has_bf16_linear() else None
        fp16_packed = kernels.fp16_pack_weight(weight.half()) if kernels.has_fp16_linear() else None
        for rows in ROWS:
            hidden = torch.randn(rows, in_features)
            for with_bias in (bias, torch.empty(0)):
                added = with_bias.double() if with_bias.numel() else 0.0
                for function, packed in packs:
                    got = getattr(kernels, function)(hidden, *packed, with_bias, in_features, out_features)
                    assert close(got, hidden.double() @ dequantized.T + added, 0, 1e-3), (function, out_features,
                                                                                          in_features, rows)
                    checked += 1
                if bf16_packed is not None:
                    rows_bf16 = hidden.bfloat16()
                    got = kernels.bf16_linear(rows_bf16, bf16_packed, with_bias, in_features, out_features)
                    expected = rows_bf16.double() @ weight.double().T + added
                    assert close(got, expected, 2**-7, 1e-3), ("bf16_linear", out_features, in_features, rows)
                    checked += 1
                if fp16_packed is not None:
                    got = kernels.fp16_linear(hidden, fp16_packed, with_bias, in_features, out_features)
                    expected = hidden.double() @ weight.half().double().T + added
                    assert close(got, expected, 1e-5, 1e-4), ("fp16_linear", out_features, in_features, rows)
                    checked += 1
    checked += check_decode(kernels) + check_cache_write(kernels) + check_sampler(kernels)
    print(f"checked {checked} calls")


def check_decode(kernels) -> int:  # type: ignore[no-untyped-def]
    """paged_decode over caches without a spare block (every block in some table, in scattered order, so that a
    read past a block in use often leaves the cache), against fp64 attention."""
    for lens, block_size, heads, kv_heads, head_dim, threads in DECODE_CASES:
        torch.set_num_threads(threads)
        used = [-(-length // block_size) for length in lens]
        key_cache, value_cache = (torch.randn(sum(used), block_size, kv_heads, head_dim).bfloat16() for _ in range(2))
        order = torch.randperm(sum(used)).to(torch.int32)
        tables = torch.zeros(len(lens), max(used), dtype=torch.int32)
        for seq, (start, count) in enumerate(zip([0, *torch.tensor(used).cumsum(0).tolist()], used)):
            tables[seq, :count] = order[start:start + count]
        query = torch.randn(len(lens), heads, head_dim).bfloat16()
        got = kernels.paged_decode(query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
        for seq, length in enumerate(lens):
            slots = [int(tables[seq, p // block_size]) * block_size + p % block_size for p in range(length)]
            keys, values = (cache.flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
                            for cache in (key_cache, value_cache))
            weights = (torch.einsum("hd,lhd->hl", query[seq].double(), keys) * 0.125).softmax(-1)
            assert close(got[seq], torch.einsum("hl,lhd->hd", weights, values), 2e-2, 2e-2), ("paged_decode", lens)
    torch.set_num_threads(2)
    return len(DECODE_CASES)


def check_cache_write(kernels) -> int:  # type: ignore[no-untyped-def]
    """write_kv_cache_ of K and V views of one projection into the cache's first and last slots, one skipped."""
    key_cache, value_cache = (torch.zeros(3, 4, 2, 24, dtype=torch.float16) for _ in range(2))
    fused = torch.randn(3, 6, 24).half()
    slots = torch.tensor([11, -1, 0])
    kernels.write_kv_cache_(fused[:, 2:4], fused[:, 4:], key_cache, value_cache, slots)
    for token, slot in ((0, 11), (2, 0)):
        assert torch.equal(key_cache.flatten(0, 1)[slot], fused[token, 2:4]), ("write_kv_cache_", slot)
        assert torch.equal(value_cache.flatten(0, 1)[slot], fused[token, 4:]), ("write_kv_cache_", slot)
    assert int((key_cache != 0).sum()) == int((fused[[0, 2], 2:4] != 0).sum())  # nothing else written
    return 1


def check_sampler(kernels) -> int:  # type: ignore[no-untyped-def]
    """sample_tokens over vocabularies off its blocks of 256, with draws at both ends of [0, 1), greedy rows and rows
    with top-k, top-p and min-p: every token inside the vocabulary, with weight where drawn, the first maximum where
    greedy."""
    checked = 0
    for vocab in (1, 5, 255, 256, 257, 3 * 256 + 7):
        logits = torch.randn(8, vocab) * 3
        logits[1, max(1, vocab // 2):] = float("-inf")  # the tail of the row masked: a top draw must not run into it
        uniforms = torch.tensor([0.0, 1 - 2**-24, 0.5, -1.0, 1 - 2**-24, -1.0, 1 - 2**-24, 0.3])  # -1: greedy
        top_k = torch.tensor([0, 0, 0, 0, 3, 0, 1, 0])
        top_p = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.9, 0.01])
        min_p = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.2, 0.5])
        tokens = kernels.sample_tokens(logits, torch.ones(8), uniforms, top_k, top_p, min_p)
        assert ((tokens >= 0) & (tokens < vocab)).all(), ("sample_tokens", vocab, tokens)
        assert all(logits[row, tokens[row]] > float("-inf") for row in range(8)), ("sample_tokens", vocab)
        for row in (3, 5, 6, 7):  # greedy, or a nucleus of one token (top-k 1; top-p 0.01)
            assert tokens[row] == logits[row].argmax(), ("sample_tokens", vocab, row)
        checked += 1
    return checked


if __name__ == "__main__":
    main()
