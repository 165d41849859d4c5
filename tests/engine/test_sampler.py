"""The sampler draws tokens with the softmax's probabilities, never a masked one, and stays inside
the vocabulary whatever the parameters and logits (NaN, infinities, subnormal temperatures)."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.beam_search import beam_step
from engine.sampler import SCAN_BLOCK, SamplingRow, sample
from engine.sampling_params import MIN_SAMPLING_TEMPERATURE
from engine.sequence import Sequence
from paged_kernels.cpu_extension import cpu_kernels


@pytest.fixture(scope="module", params=["torch", "compiled"])
def compiled(request: pytest.FixtureRequest) -> ModuleType | None:
    """What ``sample`` gets for its ``compiled`` kernels: none (its torch ops), or the CPU's, whose sampler draws the
    rows that only scale their logits by a temperature (the others stay on the torch ops)."""
    if request.param == "torch":
        return None
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here (a C++ compiler and ninja are installed)"
    return kernels


def rows(count: int, seed: int, **params: object) -> list[SamplingRow]:
    generator = torch.Generator().manual_seed(seed)
    return [SamplingRow(SamplingParams(**params), generator, [], 0, []) for _ in range(count)]


def test_random_sampling_follows_the_softmax_and_skips_zero_probability_tokens(compiled: ModuleType | None) -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    logits = probs.log().expand(4000, -1).contiguous()  # -inf where the probability is 0
    tokens = torch.tensor([r.token_id for r in sample(logits, rows(4000, seed=3, temperature=1.0), compiled)])
    counts = torch.bincount(tokens, minlength=6).float()
    assert counts[[0, 2, 5]].sum() == 0
    # binomial standard deviation at n=4000 is at most 32 counts: 4 sigma
    assert torch.all((counts - 4000 * probs).abs() < 130), counts


def test_a_vocabulary_of_many_blocks_samples_its_probabilities_across_blocks(compiled: ModuleType | None) -> None:
    # the search runs on block sums, then inside a block: mass in the tail block, in the last entry of a block,
    # in the first of the next, and whole blocks of zero probability between them
    vocab = 3 * SCAN_BLOCK + 7
    chosen = {0: 0.1, SCAN_BLOCK - 1: 0.2, SCAN_BLOCK: 0.3, 3 * SCAN_BLOCK + 6: 0.4}
    probs = torch.zeros(vocab)
    probs[list(chosen)] = torch.tensor(list(chosen.values()))
    logits = probs.log().expand(4000, -1).contiguous()
    tokens = torch.tensor([r.token_id for r in sample(logits, rows(4000, seed=7, temperature=1.0), compiled)])
    counts = torch.bincount(tokens, minlength=vocab).float()
    assert counts.sum() == counts[list(chosen)].sum() == 4000
    assert torch.all((counts - 4000 * probs).abs() < 130), counts[list(chosen)]


@pytest.mark.parametrize("vocab", [5, SCAN_BLOCK, SCAN_BLOCK + 1, 3 * SCAN_BLOCK - 1])  # one block; tails
def test_greedy_takes_the_first_of_tied_maxima_whatever_the_blocks(vocab: int, compiled: ModuleType | None) -> None:
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab))
    ties = [vocab - 1, vocab // 2, 1]  # row 0 ties at both ends of the vocabulary; row 1 ties two positions
    logits[0, ties] = logits[1, ties[1:]] = 100.0
    logits[2, vocab - 1] = 100.0  # the very last entry
    logits[3] = float("-inf")  # nothing to take: token 0, as torch's max gives
    tokens = [r.token_id for r in sample(logits, rows(4, seed=0, temperature=0.0), compiled)]
    assert tokens == [1, 1, vocab - 1, 0] == logits.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("draw", [0.0, 0.5, float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))])
def test_the_highest_draw_still_lands_on_a_token_of_positive_weight(
    monkeypatch: pytest.MonkeyPatch, draw: float, compiled: ModuleType | None) -> None:
    # weight only in the first entries of two blocks, every entry after them 0 (the tail block too): a draw at the
    # top of [0, 1) must not run on past the last weighted token
    vocab = 3 * SCAN_BLOCK + 5
    probs = torch.zeros(vocab)
    probs[[3, SCAN_BLOCK + 1]] = torch.tensor([0.25, 0.75])
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor(draw))
    (result,) = sample(probs.log()[None, :], rows(1, seed=0, temperature=1.0), compiled)
    assert result.token_id == (3 if draw < 0.25 else SCAN_BLOCK + 1)


def test_top_k_and_top_p_sampling_stays_inside_the_kept_set(compiled: ModuleType | None) -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(500, -1).contiguous()
    top_k = {r.token_id for r in sample(logits, rows(500, seed=5, temperature=1.0, top_k=2), compiled)}
    assert top_k == {0, 1}
    # probabilities ≈ .64 .24 .09 .03 .01: the nucleus for 0.8 is the first two tokens
    top_p = {r.token_id for r in sample(logits, rows(500, seed=5, temperature=1.0, top_p=0.8), compiled)}
    assert top_p == {0, 1}
    # top_k 0 leaves every token in, as -1 does (vLLM's two spellings of "off")
    unlimited = [[r.token_id for r in sample(logits, rows(500, seed=5, temperature=1.0, top_k=k), compiled)]
                 for k in (0, -1)]
    assert unlimited[0] == unlimited[1] and set(unlimited[0]) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize(("params", "kept"), [
    ({"top_k": 3}, {1, 4, 5}),
    ({"top_p": 0.85}, {1, 4, 5}),
    ({"top_k": 3, "top_p": 0.85}, {1, 4}),
    ({"min_p": 0.2, "top_p": 0.85}, {1, 4}),
], ids=["top_k", "top_p", "top_k then top_p", "min_p then top_p"])
def test_top_p_takes_its_nucleus_of_what_top_k_and_min_p_kept_as_vllm_does(
    params: dict[str, float], kept: set[int], compiled: ModuleType | None,
) -> None:
    """vLLM applies min-p, then top-k, then top-p to the probabilities of what is left, renormalized. Weights 0.03, 1,
    0.06, 0.04, 0.5, 0.25 (total 1.88): top-p 0.85 of the whole keeps the third largest (1.5 before it, below 1.598);
    of the top 3's mass, or of what min-p 0.2 kept (1.75 either way), it drops it (1.5 is past 1.4875)."""
    logits = torch.tensor([0.03, 1.0, 0.06, 0.04, 0.5, 0.25]).log().expand(400, -1).contiguous()
    drawn = {r.token_id for r in sample(logits, rows(400, seed=11, temperature=1.0, **params), compiled)}
    assert drawn == kept


def test_a_seeded_row_draws_the_same_tokens_alone_or_in_a_batch(compiled: ModuleType | None) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    alone = sample(logits[1:2].clone(), rows(1, seed=11, temperature=1.0), compiled)[0].token_id
    batch = rows(3, seed=99, temperature=1.0)
    batch[1] = rows(1, seed=11, temperature=1.0)[0]
    assert sample(logits.clone(), batch)[1].token_id == alone


COMPARED_PARAMS = [  # per row of the comparison below, in turn
    {"temperature": 0.0}, {"temperature": 0.2}, {"temperature": 0.7}, {"temperature": 1.0}, {"temperature": 2.0},
    {"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.0, "top_p": 0.5}, {"temperature": 0.8, "top_k": 40},
    {"temperature": 1.0, "top_k": 2}, {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.01},
    {"temperature": 1.0, "repetition_penalty": 1.3, "top_p": 0.9}, {"temperature": 1.0, "logit_bias": {5: 30.0}},
]


@pytest.mark.parametrize("scale", [4.0, 12.0], ids=["flat", "peaked"])
def test_the_compiled_sampler_draws_what_the_torch_ops_draw(scale: float) -> None:
    """The same logits and generators give the same tokens both ways, greedy and random, at temperatures from 0.2
    to 2, with top-k, top-p and min-p, and after logit edits, over SmolLM2's vocabulary, in distributions flat
    (thousands of tokens in a 0.95 nucleus) and peaked (a few); rows with masked tokens and a NaN row included. Sums
    run in another order, so a draw or a nucleus within rounding of a boundary between two tokens could differ:
    none among these."""
    kernels = cpu_kernels()
    assert kernels is not None
    logits = torch.randn(3 * len(COMPARED_PARAMS), 49152, generator=torch.Generator().manual_seed(3)) * scale
    logits[1, 1000:40000] = float("-inf")
    logits[2, 7] = float("nan")  # falls back to its finite logits' argmax
    logits[3, 49151] = 60.0 * scale  # the last entry takes nearly all the mass

    def draw(compiled: ModuleType | None) -> list[int]:
        batch = [SamplingRow(SamplingParams(**COMPARED_PARAMS[i % len(COMPARED_PARAMS)]),
                             torch.Generator().manual_seed(i), list(range(i, i + 20)), 10, [])
                 for i in range(logits.shape[0])]
        return [r.token_id for r in sample(logits, batch, compiled)]

    tokens = draw(kernels)
    assert tokens == draw(None)
    assert tokens[2] == int(logits[2].nan_to_num(nan=float("-inf")).argmax()) and tokens[3] == 49151
    assert len(set(tokens)) > len(tokens) // 2  # random draws, not one token


@pytest.mark.parametrize(("top_k", "top_p", "min_p", "kept"), [
    (0, 1.0, 0.0, {0, 1, 2, 3, 4, 5}),
    (0, 1.0, 0.05, {1, 2, 4, 5}),  # weights below 0.05 of the largest's: 0.03 and 0.04
    (2, 1.0, 0.0, {1, 4}),
    (3, 1.0, 0.0, {1, 4, 5}),
    (0, 0.5, 0.0, {1}),  # the largest alone holds 1 / 1.88 of the mass: past half
    (0, 0.7, 0.0, {1, 4}),  # 1.0 before the second: below 0.7 * 1.88; 1.5 before the third: past it
    (0, 0.85, 0.0, {1, 4, 5}),  # 1.5 before the third: below 0.85 * 1.88
    (3, 0.85, 0.0, {1, 4}),  # top-p of the top 3's mass (1.75): 1.5 is past 0.85 * 1.75
    (0, 0.85, 0.2, {1, 4}),  # top-p of what min-p kept (1.75 again)
    (3, 0.85, 0.3, {1, 4}),
], ids=["none", "min_p", "top_k 2", "top_k 3", "top_p 0.5", "top_p 0.7", "top_p 0.85", "top_k then top_p",
        "min_p then top_p", "all three"])
def test_the_compiled_sampler_draws_only_from_the_tokens_its_filters_keep(
    top_k: int, top_p: float, min_p: float, kept: set[int],
) -> None:
    """Weights 0.03, 1, 0.06, 0.04, 0.5, 0.25 (total 1.88): draws at every thousandth of [0, 1) land on exactly the
    tokens top-k, top-p and min-p keep (each holds at least 2% of what is kept)."""
    kernels = cpu_kernels()
    assert kernels is not None
    rows = 1000
    logits = torch.tensor([0.03, 1.0, 0.06, 0.04, 0.5, 0.25]).log().expand(rows, -1).contiguous()
    tokens = kernels.sample_tokens(logits, torch.ones(rows), torch.arange(rows, dtype=torch.float32) / rows,
                                   torch.full((rows,), top_k), torch.full((rows,), top_p), torch.full((rows,), min_p))
    assert set(tokens.tolist()) == kept


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: a.__setitem__(0, a[0].double()), "logits must be a contiguous 2-D fp32"),
    (lambda a: a.__setitem__(0, a[0].t()), "logits must be a contiguous 2-D fp32"),
    (lambda a: a.__setitem__(1, a[1][:1]), "inverse_temperatures must hold one Float value per row"),
    (lambda a: a.__setitem__(2, a[2].double()), "uniforms must hold one Float value per row"),
    (lambda a: a.__setitem__(3, a[3].int()), "top_k must hold one Long value per row"),
    (lambda a: a.__setitem__(4, a[4][:2]), "top_p must hold one Float value per row"),
    (lambda a: a.__setitem__(5, a[5].view(3, 1)), "min_p must hold one Float value per row"),
], ids=["fp64", "strided", "temperatures", "uniforms", "top_k", "top_p", "min_p"])
def test_the_compiled_sampler_names_what_is_wrong(change, message: str) -> None:  # type: ignore[no-untyped-def]
    kernels = cpu_kernels()
    assert kernels is not None
    arguments = [torch.randn(3, 3), torch.ones(3), torch.rand(3), torch.zeros(3, dtype=torch.long), torch.ones(3),
                 torch.zeros(3)]
    change(arguments)
    with pytest.raises(RuntimeError, match=message):
        kernels.sample_tokens(*arguments)


# ---- numerical safety ------------------------------------------------------------------------
EXTREME_TEMPERATURES = [1e-45, 1e-40, 1e-6, 1e-5, 0.5, 1.0, 100.0, 1e30, 3.4e38, 1e300]
logit_values = st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from([3.4e38, -3.4e38, 1e-45])


@st.composite
def sampling_rows(draw: st.DrawFn, vocab: int) -> SamplingRow:
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.0, *EXTREME_TEMPERATURES]) | st.floats(0.0, 1e38)),
        top_k=draw(st.sampled_from([-1, 0, 1, 2, vocab, 10 * vocab])),
        top_p=draw(st.floats(1e-9, 1.0)),
        min_p=draw(st.floats(0.0, 1.0)),
        repetition_penalty=draw(st.sampled_from([0.01, 0.5, 1.0, 2.0, 100.0])),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        logprobs=draw(st.none() | st.integers(0, 3)),
        seed=draw(st.integers(0, 2**32)),
    )
    token_ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
    suppressed = draw(st.lists(st.integers(0, vocab - 1), max_size=vocab))
    generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, generator, token_ids, draw(st.integers(0, len(token_ids))), suppressed)


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingRow]]:
    vocab = draw(st.integers(1, 24))
    num_rows = draw(st.integers(1, 4))
    values = draw(st.lists(logit_values, min_size=vocab * num_rows, max_size=vocab * num_rows))
    logits = torch.tensor(values, dtype=torch.float32).view(num_rows, vocab)
    return logits, [draw(sampling_rows(vocab)) for _ in range(num_rows)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches())
def test_any_parameters_and_logits_give_in_vocabulary_tokens_and_finite_logprobs(
    batch: tuple[torch.Tensor, list[SamplingRow]], compiled: ModuleType | None,
) -> None:
    logits, batch_rows = batch
    raw = logits.clone()
    results = sample(logits, batch_rows, compiled)
    assert torch.equal(logits.nan_to_num(), raw.nan_to_num())  # the caller's logits are never edited
    for result, row in zip(results, batch_rows):
        assert 0 <= result.token_id < logits.shape[-1]
        if row.params.logprobs is not None:
            assert result.token_id in result.logprobs
            assert all(math.isfinite(v) and v <= 0 for v in result.logprobs.values())


@settings(max_examples=100, deadline=None)
@given(values=st.lists(logit_values, min_size=2, max_size=16), temperature=st.sampled_from(EXTREME_TEMPERATURES))
def test_a_row_with_nan_or_infinite_logits_takes_the_argmax_of_its_finite_ones(
    values: list[float], temperature: float, compiled: ModuleType | None,
) -> None:
    logits = torch.tensor([values], dtype=torch.float32)
    logits[0, 0] = float("nan")
    logits[0, -1] = float("inf")
    finite = logits.nan_to_num(nan=float("-inf"), posinf=float("-inf"), neginf=float("-inf"))
    expected = int(finite.argmax()) if bool(torch.isfinite(finite).any()) else 0
    assert sample(logits, rows(1, seed=0, temperature=temperature), compiled)[0].token_id == expected


def test_a_row_whose_every_token_is_masked_falls_back_to_greedy(compiled: ModuleType | None) -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    row = SamplingRow(SamplingParams(temperature=1.0, top_k=1), torch.Generator(), [], 0, [0, 1, 2, 3])
    assert sample(logits, [row], compiled)[0].token_id in range(4)
    row.suppressed_token_ids = [1, 3]
    assert sample(logits, [row], compiled)[0].token_id == 2  # the one kept by top_k=1 after suppression


def test_temperature_too_small_to_divide_by_is_greedy(compiled: ModuleType | None) -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]]).expand(50, -1).contiguous()
    assert SamplingParams(temperature=1e-40).greedy
    assert {r.token_id for r in sample(logits, rows(50, seed=1, temperature=1e-40), compiled)} == {1}
    assert not SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE).greedy


def test_huge_logits_and_temperatures_sample_finite_probabilities(compiled: ModuleType | None) -> None:
    logits = torch.tensor([[1e38, -1e38, 5e37, float("-inf")]]).expand(400, -1).contiguous()
    assert {r.token_id for r in sample(logits, rows(400, seed=2, temperature=1e-5), compiled)} == {0}
    # at an enormous temperature (inf in fp32) the finite logits become about equally likely;
    # the masked one is never drawn
    assert {r.token_id for r in sample(logits, rows(400, seed=2, temperature=1e300), compiled)} == {0, 1, 2}
    # equal huge logits stay a fair draw: divided before shifting by their max they would overflow
    tied = torch.tensor([[2e38, 2e38, -1.0]]).expand(400, -1).contiguous()
    assert {r.token_id for r in sample(tied, rows(400, seed=2, temperature=0.5), compiled)} == {0, 1}


# ---- device placement --------------------------------------------------------------------------
def test_sampler_and_beam_search_create_every_tensor_on_the_logits_device(compiled: ModuleType | None) -> None:
    """With the default device set elsewhere (meta), a tensor made without ``device=`` would not
    meet the logits' device, as a CPU tensor would not meet CUDA logits."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    expected = sample(logits, _mixed_rows(), compiled)
    plain = sample(logits, rows(3, seed=1, temperature=0.8, logprobs=1), compiled)
    with torch.device("meta"):
        assert sample(logits, _mixed_rows(), compiled) == expected
        assert sample(logits, rows(3, seed=1, temperature=0.8, logprobs=1), compiled) == plain
        beams = [Sequence([1, 2, 3], 2), Sequence([1, 2, 4], 2)]
        step = beam_step(beams, logits[:2], 2, 5, 1.0, {0}, [])
    assert all(0 <= c.token_id < 40 for c in step.choices)


def _mixed_rows() -> list[SamplingRow]:
    kinds = [
        dict(temperature=0.0, repetition_penalty=1.3, logprobs=2),
        dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3, seed=4),
        dict(temperature=1.2, seed=5, logprobs=0),
    ]
    return [
        SamplingRow(SamplingParams(**kind), torch.Generator().manual_seed(i), [1, 2, 2, 7], 2, [3])
        for i, kind in enumerate(kinds)
    ]
