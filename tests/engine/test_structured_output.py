"""Structured outputs (vLLM's ``structured_outputs``): the output follows its JSON schema, regex, choice or grammar
whatever the model would rather say (here a random tiny Llama, which never would by chance), through sampling,
n > 1, preemption and a fault's rollback, and a constraint never changes the other requests of its batch."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import llguidance.hf
import pytest
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from core.structured_outputs import StructuredOutputError
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.model_files import load_tokenizer
from engine.outputs import RequestOutput
from engine.sampler import SamplingRow, sample
from engine.structured_output import GrammarCompiler, TokenizerMismatchError
from tests.conftest import tiny_block_bytes
from tests.engine.hf_reference import hf_logprobs
from tests.engine.test_fault_isolation import poisoned

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
# compact JSON: a random model would otherwise spend its tokens on the whitespace JSON allows between tokens
COMPACT_PERSON = {"json": PERSON, "disable_any_whitespace": True}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", seed=1)


def _texts(outputs: list[RequestOutput]) -> list[str]:
    return [c.text for out in outputs for c in out.outputs]


def test_sampled_json_follows_its_schema(llm: LLM) -> None:
    params = [SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=64, structured_outputs=COMPACT_PERSON)
              for seed in range(4)]
    outputs = llm.generate(["Tell me about a person"] * 4, params, use_tqdm=False)
    for out in outputs:
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), PERSON)


@pytest.mark.parametrize(("spec", "accepts"), [
    ({"regex": DATE}, lambda text: re.fullmatch(DATE, text) is not None),
    ({"choice": ["red", "green", "dark blue"]}, lambda text: text in ("red", "green", "dark blue")),
    ({"grammar": 'root ::= ("yes" | "no") ", " [0-9] [0-9]?'}, lambda text: re.fullmatch(r"(yes|no), \d\d?", text)),
    ({"grammar": 'start: "<" WORD ">"\nWORD: /[a-z]{1,6}/'}, lambda text: re.fullmatch(r"<[a-z]{1,6}>", text)),
    ({"json_object": True, "disable_any_whitespace": True}, lambda text: isinstance(json.loads(text), dict)),
])
def test_each_kind_of_constraint_holds_greedy_and_sampled(llm: LLM, spec: dict[str, Any], accepts: Any) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=spec),
              SamplingParams(n=3, temperature=1.2, seed=5, max_tokens=48, structured_outputs=spec)]
    for out in llm.generate(["Answer:", "Answer:"], params, use_tqdm=False):
        for completion in out.outputs:
            if completion.finish_reason == "stop":
                assert accepts(completion.text), completion.text
            else:  # json_object's free strings may run out of tokens: the prefix must still be JSON-like
                assert spec.get("json_object") and completion.text.startswith("{")


def test_a_constrained_request_leaves_the_rest_of_its_batch_alone(llm: LLM) -> None:
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)]
    prompts = ["The weather today", "Once upon a time"]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=40, structured_outputs={"regex": DATE})
    mixed = llm.generate([prompts[0], "Date:", prompts[1]], [plain[0], constrained, plain[1]], use_tqdm=False)
    assert [c.token_ids for c in mixed[0].outputs] == [c.token_ids for c in alone[0].outputs]
    assert [c.token_ids for c in mixed[2].outputs] == [c.token_ids for c in alone[1].outputs]
    assert all(re.fullmatch(DATE, text) for text in _texts([mixed[1]]))


def test_greedy_takes_the_likeliest_token_the_grammar_allows(llm: LLM, tiny_model_dir: Path) -> None:
    # a choice of words whose first tokens differ: greedy must take the word whose first token transformers rates
    # higher after the prompt, then the rest of it
    words = ["alpha", "zebra", "moon"]
    first = [llm.tokenizer.encode(w)[0] for w in words]
    prompt_ids = llm.tokenizer.encode("Pick one:")
    scores = hf_logprobs(tiny_model_dir, prompt_ids, [first[0]])[0]
    expected = max(words, key=lambda w: float(scores[first[words.index(w)]]))
    out = llm.generate(prompt_ids,
                       SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": words}),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == expected and out.outputs[0].finish_reason == "stop"


def test_the_sampler_never_draws_a_token_the_grammar_forbids(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB")
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.limits.vocab_size, llm.engine.eos_token_ids)
    state = compiler.start({"regex": "[a-z]+"})
    allowed = {t for t in range(llm.engine.limits.vocab_size) if re.fullmatch("[a-z]+", llm.tokenizer.decode([t]))}
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, llm.engine.limits.vocab_size, generator=generator) * 5
    rows = [SamplingRow(SamplingParams(temperature=2.0), generator, [1], 1, [], state) for _ in range(64)]
    drawn = {result.token_id for result in sample(logits, rows)}
    assert drawn <= allowed and len(drawn) > 30


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_constrained_samples_match_an_unpressured_run(tiny_model_dir: Path, mode: str) -> None:
    def run(llm: LLM) -> list[str]:
        params = [SamplingParams(n=2, seed=i, temperature=1.0, max_tokens=32, structured_outputs=COMPACT_PERSON)
                  for i in range(4)]
        return _texts(llm.generate([f"Person number {i}" for i in range(4)], params, use_tqdm=False))

    block_bytes = tiny_block_bytes(dtype="float32")
    tight = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=8 * block_bytes,
                swap_space=16 * block_bytes, watermark=0.0, preemption_mode=mode)
    pressured = run(tight)
    stats = tight.stats()
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    assert pressured == run(LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB"))


def test_a_rolled_back_step_puts_the_grammar_back_too(llm: LLM) -> None:
    # the faulty request's token raises while its step's tokens are detokenized: after they were appended and
    # taken by the grammars; the constrained victim must recompute from the grammar state before that step
    params = SamplingParams(n=2, seed=4, temperature=1.0, max_tokens=40, structured_outputs=COMPACT_PERSON)
    clean = _texts(llm.generate(["Tell me about a person"], params, use_tqdm=False))
    poison = next(t for t in range(1000, 2000) if "{" not in llm.tokenizer.decode([t]))
    engine = llm.engine
    finished: dict[str, RequestOutput] = {}
    with poisoned(llm, "detokenize", poison):
        engine.add_request("victim", "Tell me about a person", params)
        for _ in range(3):
            engine.step()
        engine.add_request("faulty", llm.tokenizer.encode("Repeat:") + [poison],
                           SamplingParams(temperature=0.0, max_tokens=4))
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["faulty"].error is not None and finished["victim"].error is None
    assert _texts([finished["victim"]]) == clean


@pytest.mark.parametrize(("spec", "field"), [
    ({"regex": "[0-9"}, "structured_outputs.regex"),
    ({"json": {"type": "strnig"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
])
def test_a_bad_constraint_is_refused_by_name_and_the_engine_serves_on(llm: LLM, spec: dict[str, Any],
                                                                      field: str) -> None:
    engine = llm.engine
    engine.add_request("bystander", "Hello there", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    with pytest.raises(StructuredOutputError, match=re.escape(field)):
        engine.add_request("bad", "Hello", SamplingParams(structured_outputs=spec))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["bystander"] and len(outputs[0].outputs[0].token_ids) == 6


def test_the_default_models_tokenizer_converts_as_byte_level_bpe() -> None:
    # transformers 5.17 converted SmolLM2's GGUF tokenizer with sentencepiece byte fallback: llguidance then read
    # "Ġb" as those bytes, and every grammar with a space refused the model's tokens (on a GPU image, 2026-12-04)
    spec = json.loads(load_tokenizer("smollm2-135m-instruct").backend_tokenizer.to_str())
    assert spec["decoder"]["type"] == "ByteLevel"
    assert not spec["model"].get("byte_fallback")


def test_a_tokenizer_llguidance_misreads_is_refused_once_with_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    # the tokenizer transformers 5.17 made of SmolLM2's GGUF: sentencepiece byte fallback over byte-level BPE
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, spec["decoder"]]}
    spec["model"]["byte_fallback"] = True
    misread = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                      eos_token=tokenizer.eos_token)
    compiler = GrammarCompiler(misread, len(tokenizer), {tokenizer.eos_token_id})
    builds = []
    from_tokenizer = llguidance.hf.from_tokenizer
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: builds.append(1) or from_tokenizer(*a, **k))
    for spec in ({"choice": ["a b"]}, {"regex": "[a-z]+"}):  # a later constraint: the same refusal, no rebuild
        with pytest.raises(TokenizerMismatchError, match="transformers < 5.25"):
            compiler.compile(spec)
    assert len(builds) == 1
    GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id}).compile({"choice": ["a b"]})  # the right one


def test_vllms_structured_outputs_params_class_is_accepted(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["a b"]))
    assert params.structured_outputs == {"choice": ["a b"]}
    assert llm.generate("Say:", params, use_tqdm=False)[0].outputs[0].text == "a b"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"structured_outputs": "a+"}, "structured_outputs must be None or a dict"),
    ({"structured_outputs": {"regex": "a"}, "beam_width": 2}, "beam search"),
])
def test_sampling_params_name_a_malformed_constraint(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("spec", [{"regex": "(a{1000}){1000}"}, {"regex": "[^\\s\\S]"}])
def test_a_constraint_that_breaks_down_while_generating_fails_its_request_alone(
    llm: LLM, spec: dict[str, Any]
) -> None:
    # both compile; llguidance gives up on the first at its first token (too many lexer states), the second allows
    # nothing at all: neither output can follow its constraint, so neither may end as if it had ("stop")
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (alone,) = llm.generate(["The weather today"], plain, use_tqdm=False)
    broken = SamplingParams(temperature=1.0, seed=2, max_tokens=4, structured_outputs=spec)
    bystander, failed = llm.generate(["The weather today", "Letters:"], [plain, broken], use_tqdm=False)
    assert failed.error is not None and failed.refused and "structured_outputs.regex could not be followed" in \
        failed.error
    assert all(c.finish_reason == "error" for c in failed.outputs)
    assert bystander.error is None and bystander.outputs[0].token_ids == alone.outputs[0].token_ids
