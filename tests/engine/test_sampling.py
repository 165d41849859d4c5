"""Sampling features against straightforward reference computations on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.bad_words import bad_words_token_ids, banned_next_tokens
from engine.detokenizer import decode_new_text, start_offsets
from engine.sequence import Sequence
from tests.engine.hf_reference import hf_greedy, hf_logprobs

PROMPT = "The quick brown fox jumps over the lazy dog because"
VOCAB_SIZE = 49152  # SmolLM2's, which the tiny model shares


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    # exact numerics: logprobs are checked against transformers' fp32 log-softmax
    return LLM(model=str(tiny_model_dir), dtype="float32", cpu_weight_packing="exact", kv_cache_memory="8MiB", seed=1)


def greedy(llm: LLM, prompt: str = PROMPT, **kwargs: object) -> object:
    params = SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 24, **kwargs})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_stop_string_ends_text_before_the_stop(llm: LLM) -> None:
    full = greedy(llm)
    stop = full.text[10:14]
    index = full.text.index(stop)
    out = greedy(llm, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full.text[:index]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_id_ends_generation_including_it_in_the_ids_not_the_text(llm: LLM) -> None:
    full = greedy(llm)
    stop_token = full.token_ids[5]
    first = full.token_ids.index(stop_token)
    out = greedy(llm, stop_token_ids=[stop_token])
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first + 1]
    # as vLLM: the stop token's own text is left out (here an ordinary token, whose text would show)
    assert out.text == llm.tokenizer.decode(full.token_ids[:first])
    assert out.text != llm.tokenizer.decode(full.token_ids[: first + 1])


def test_include_stop_str_in_output_keeps_the_stop_string_or_token_text(llm: LLM) -> None:
    full = greedy(llm)
    stop = full.text[10:14]
    out = greedy(llm, stop=[stop], include_stop_str_in_output=True)
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop) + len(stop)]
    stop_token = full.token_ids[5]
    first = full.token_ids.index(stop_token)
    out = greedy(llm, stop_token_ids=[stop_token], include_stop_str_in_output=True)
    assert out.text == llm.tokenizer.decode(full.token_ids[: first + 1])


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_output_as_vllm(llm: LLM) -> None:
    full = greedy(llm)
    assert full.finish_reason == "length" and full.stop_reason is None
    stop = full.text[10:14]
    assert greedy(llm, stop=["never in the text", stop]).stop_reason == stop
    stop_token = full.token_ids[5]
    assert greedy(llm, stop_token_ids=[stop_token]).stop_reason == stop_token
    eos = min(llm.engine.eos_token_ids)  # the only token allowed: it ends the output with no stop reason (vLLM)
    params = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[eos], stop_token_ids=[eos])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and out.stop_reason is None


def test_text_reported_while_running_never_holds_what_a_stop_string_cuts(llm: LLM) -> None:
    full = greedy(llm)
    # a stop string across a token boundary: its first characters end one step's text, the step after cuts them
    ends = [len(llm.tokenizer.decode(full.token_ids[:k])) for k in range(1, len(full.token_ids))]
    end = next(e for e, after in zip(ends, ends[1:]) if after - e >= 2 and e > len(full.text) // 2)
    stop = full.text[end - 2 : end + 2]
    engine = llm.engine
    engine.add_request("stop-buffer", PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24,
                                                             stop=[stop]))
    reported = []
    while engine.has_unfinished_requests():
        reported += [out.outputs[0].text for out in engine.step() if out.request_id == "stop-buffer"]
    final = reported[-1]
    assert final == full.text[: full.text.index(stop)] and len(reported) > 2
    assert all(final.startswith(text) for text in reported)


def test_logit_bias_moves_greedy_choices_and_leaves_logprobs_raw(llm: LLM) -> None:
    plain = greedy(llm, logprobs=2)
    first = plain.token_ids[0]
    (runner_up,) = [t for t in plain.logprobs[0] if t != first]  # the raw model's second choice
    out = greedy(llm, logit_bias={first: -100.0}, logprobs=0)
    assert out.token_ids[0] == runner_up
    assert out.logprobs[0][runner_up] == pytest.approx(plain.logprobs[0][runner_up], abs=1e-5)  # not the biased
    forced = greedy(llm, logit_bias={str(runner_up): 100.0}, max_tokens=6)  # JSON's text keys are token ids too
    assert forced.token_ids == [runner_up] * 6


def test_allowed_token_ids_limit_every_draw(llm: LLM) -> None:
    plain = greedy(llm, logprobs=3)
    first, second, third = sorted(plain.logprobs[0], key=plain.logprobs[0].get, reverse=True)
    assert greedy(llm, allowed_token_ids=[third, second]).token_ids[0] == second
    params = SamplingParams(n=4, max_tokens=8, temperature=2.0, seed=3, ignore_eos=True,
                            allowed_token_ids=[first, third, 17])
    outputs = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    drawn = {t for out in outputs for t in out.token_ids}
    assert drawn <= {first, third, 17} and len(drawn) > 1


def test_bad_words_take_the_runner_up_where_greedy_would_spell_them(llm: LLM) -> None:
    plain = greedy(llm, logprobs=2)
    runner_up = [next(t for t in top if t != chosen) for chosen, top in zip(plain.token_ids, plain.logprobs)]
    # a one-token word: its token is masked from the first step on
    word = llm.tokenizer.decode(plain.token_ids[:1])
    assert greedy(llm, bad_words=[word]).token_ids[0] == runner_up[0]
    # a two-token word: its second token is masked only right after its first, so the output is the same up to there
    variants = bad_words_token_ids(llm.tokenizer, [llm.tokenizer.decode(plain.token_ids[3:5])], VOCAB_SIZE)
    assert plain.token_ids[3:5] in variants
    out = greedy(llm, bad_words=[llm.tokenizer.decode(plain.token_ids[3:5])])
    assert out.token_ids[:4] == plain.token_ids[:4] and out.token_ids[4] == runner_up[4]
    for ids in variants:
        assert all(out.token_ids[i:i + len(ids)] != ids for i in range(len(out.token_ids)))


def test_banned_next_tokens_complete_a_bad_word_after_its_other_tokens() -> None:
    words = [[5], [7, 8], [7, 9, 10]]
    assert banned_next_tokens(words, [7, 9], prompt_len=2) == [5]  # the output alone counts, not the prompt
    assert banned_next_tokens(words, [3, 1, 7], prompt_len=1) == [5, 8]
    assert banned_next_tokens(words, [3, 7, 9], prompt_len=1) == [5, 10]
    assert banned_next_tokens(words, [7, 9], prompt_len=1) == [5]


def test_a_requests_bias_and_allowed_tokens_become_tensors_once(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=5, ignore_eos=True, allowed_token_ids=[5, 6], logit_bias={"5": 1.0})
    engine.add_request("edits-once", PROMPT, params)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        if (group := engine.output_processor.groups.get("edits-once")) is not None:
            seen.append(group.logit_edits)
    assert len(seen) >= 3 and all(edits is seen[0] for edits in seen)
    assert seen[0].allowed_ids.tolist() == [5, 6] and seen[0].bias_ids.tolist() == [5]


def test_a_row_with_every_allowed_token_masked_still_draws_an_allowed_one(llm: LLM) -> None:
    (allowed,) = llm.tokenizer.encode(" z")  # the grammar masks the only allowed token: nothing is left to draw from
    for temperature in (0.0, 1.0):
        params = SamplingParams(allowed_token_ids=[allowed], max_tokens=2, temperature=temperature, seed=1,
                                ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=["yes"]))
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
        assert out.token_ids[0] == allowed


@pytest.mark.parametrize("stop_token_ids", [[], [7]])
def test_min_tokens_with_only_stop_tokens_allowed_is_refused(llm: LLM, stop_token_ids: list[int]) -> None:
    (eos,) = llm.engine.eos_token_ids  # min_tokens holds back every allowed token: no token could be sampled
    params = SamplingParams(allowed_token_ids=[eos, *stop_token_ids], stop_token_ids=stop_token_ids, min_tokens=2)
    with pytest.raises(ValueError, match="allowed_token_ids holds only stop tokens"):
        llm.engine.add_request("held-back", PROMPT, params)
    ignoring_eos = SamplingParams(allowed_token_ids=[eos], min_tokens=2, max_tokens=3, ignore_eos=True)
    (out,) = llm.generate([PROMPT], ignoring_eos, use_tqdm=False)[0].outputs
    assert out.token_ids == [eos] * 3


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"logit_bias": {VOCAB_SIZE: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [0, VOCAB_SIZE]}, "allowed_token_ids"),
])
def test_token_ids_past_the_vocabulary_are_refused_at_add_request(llm: LLM, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request("past-vocab", PROMPT, SamplingParams(**kwargs))


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_decides_whether_special_tokens_show_in_the_text(llm: LLM, skip: bool) -> None:
    special = llm.tokenizer.encode("<|im_start|>")
    assert len(special) == 1
    words = llm.tokenizer.encode(" tool call")
    prompt = llm.tokenizer.encode("Hi")
    seq = Sequence(token_ids=prompt + special + words, prompt_len=len(prompt))
    start_offsets(seq)
    text = decode_new_text(llm.tokenizer, seq, final=True, skip_special_tokens=skip)
    assert text == (" tool call" if skip else "<|im_start|> tool call")


def test_min_tokens_suppresses_stops_until_reached(llm: LLM) -> None:
    full = greedy(llm)
    stop_token = full.token_ids[5]  # greedy's choice at the sixth output, the last one min_tokens=6 covers
    assert full.token_ids.index(stop_token) == 5
    out = greedy(llm, stop_token_ids=[stop_token], min_tokens=6)
    assert out.token_ids[:5] == full.token_ids[:5]
    assert len(out.token_ids) >= 6 and stop_token not in out.token_ids[:6]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop_token and stop_token not in out.token_ids[:-1]


def test_max_tokens_gives_length_finish(llm: LLM) -> None:
    out = greedy(llm, max_tokens=7)
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_repetition_penalty_matches_transformers(llm: LLM, tiny_model_dir: Path) -> None:
    expected = hf_greedy(tiny_model_dir, [PROMPT], 24, repetition_penalty=1.5)[0]
    assert greedy(llm, repetition_penalty=1.5).token_ids == expected


class OpenAIPenalties:
    """presence/frequency penalties over generated tokens, written out plainly."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for token in set(input_ids[0, self.prompt_len :].tolist()):
            count = input_ids[0, self.prompt_len :].tolist().count(token)
            scores[0, token] -= self.presence + self.frequency * count
        return scores


def test_presence_and_frequency_penalties_match_reference(llm: LLM, tiny_model_dir: Path) -> None:
    prompt_len = len(llm.tokenizer.encode(PROMPT))
    processor = OpenAIPenalties(prompt_len, presence=0.8, frequency=0.6)
    expected = hf_greedy(tiny_model_dir, [PROMPT], 24, logits_processor=processor)[0]
    assert greedy(llm, presence_penalty=0.8, frequency_penalty=0.6).token_ids == expected


def test_logprobs_match_model_log_softmax(llm: LLM, tiny_model_dir: Path) -> None:
    out = greedy(llm, max_tokens=6, logprobs=3)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    reference = hf_logprobs(tiny_model_dir, prompt_ids, out.token_ids)
    assert len(out.logprobs) == 6
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = reference[position].topk(3)
        assert set(top.indices.tolist()) | {token} == set(entry)
        for candidate, value in entry.items():
            assert value == pytest.approx(float(reference[position, candidate]), abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["Another prompt", PROMPT, "Third one here"], [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=99, ignore_eos=True)
    assert llm.generate([PROMPT], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm: LLM) -> None:
    sampled = llm.generate([PROMPT], SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert sampled.token_ids == greedy(llm, max_tokens=12).token_ids


def test_parallel_samples_share_prompt_blocks(tiny_model_dir: Path) -> None:
    prompt = " ".join(["word"] * 60)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)

    def peak_blocks(requests: list[SamplingParams]) -> int:
        llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)
        for i, p in enumerate(requests):
            llm.engine.add_request(str(i), prompt, p)
        peak = 0
        while llm.engine.has_unfinished_requests():
            outputs = llm.engine.step()
            stats = llm.stats()
            peak = max(peak, stats.num_total_blocks - stats.num_free_blocks)
        assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
        return peak, outputs

    shared, outputs = peak_blocks([params])
    separate, _ = peak_blocks(
        [SamplingParams(temperature=1.0, max_tokens=8, seed=s, ignore_eos=True) for s in range(4)])
    assert len(outputs[0].outputs) == 4
    assert shared < separate


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 1000}, "logprobs"),
        ({"temperature": float("nan")}, "temperature"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"repetition_penalty": 1e6}, "repetition_penalty"),
        ({"length_penalty": 1e6}, "length_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"n": True}, "n"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {5: 1.0}, "beam_width": 2}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3], "beam_width": 2}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": [7]}, "bad_words"),
        ({"bad_words": ["fox"], "beam_width": 2}, "bad_words"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="context"):
        llm.generate(["word " * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="model"):
        LLM(model="no-such-model")
    with pytest.raises(ValueError, match="model"):
        LLM(model="/nonexistent/weights.gguf")
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()], use_tqdm=False)
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    assert greedy(llm, max_tokens=3).finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ("Hi", {"stop_token_ids": [1_000_000_000], "min_tokens": 1}, "stop_token_ids"),
        ("Hi", {"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
        ([1, VOCAB_SIZE], {}, "prompt"),
        ([-1], {}, "prompt"),
        ("Hi", {"max_tokens": 10_000}, "max_tokens"),
        ("Hi", {"n": 64, "max_tokens": 400}, "KV blocks"),
    ],
)
def test_add_request_refuses_what_the_model_cannot_run(llm: LLM, prompt: object, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request(f"refused-{field}-{prompt}", prompt, SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished_requests()


def test_add_request_refuses_a_priority_that_cannot_order_the_queues(llm: LLM) -> None:
    with pytest.raises(ValueError, match="priority"):
        llm.engine.add_request("nan-priority", "Hi", SamplingParams(), priority=float("nan"))
    assert not llm.engine.has_unfinished_requests()


def test_engine_limits_use_the_vocabulary_size_of_the_model_config(llm: LLM, tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert llm.engine.limits.vocab_size == config["vocab_size"] == VOCAB_SIZE
    assert llm.engine.limits.max_model_len == llm.engine.max_model_len


def test_temperature_too_small_to_divide_by_decodes_greedily(llm: LLM) -> None:
    params = SamplingParams(temperature=1e-40, max_tokens=12, ignore_eos=True, seed=3)
    tiny = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert tiny.token_ids == greedy(llm, max_tokens=12).token_ids


def test_chat_applies_the_chat_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is two plus two?"}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    rendered = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "What is two plus two?" in rendered and rendered != messages[0]["content"]
    assert chat.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    direct = llm.generate([chat.prompt_token_ids], params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"content": "no role"}], params)
