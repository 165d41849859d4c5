"""Run by test_kernels_under_asan.py in a process with AddressSanitizer's runtime preloaded: the CPU's linear kernels,
built with ``-fsanitize=address``, over shapes off their blocks and row counts across their passes, each result
checked against fp64. A read or write outside a tensor aborts the process with ASan's report; a wrong value fails an
assertion."""

from __future__ import annotations

import torch

from paged_kernels.cpu_extension import SOURCES, build_kernels

SHAPES = [(1, 1), (1, 2), (5, 37), (31, 3), (33, 5), (65, 8), (67, 100), (97, 33), (130, 70)]
ROWS = [0, 1, 2, 3, 5, 6, 7, 12, 13, 19]


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
    print(f"checked {checked} calls")


if __name__ == "__main__":
    main()
