"""Generated tokens → text and results: detokenizing, stop checks and each step's ``RequestOutput``s."""

from __future__ import annotations

from typing import Any

from engine.beam_search import best_hypotheses
from engine.detokenizer import decode_new_text, find_stop_string
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup


class OutputProcessor:
    """Keeps the live requests by id, decides when a new token ends its sequence, and reports requests."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.groups: dict[str, SequenceGroup] = {}  # added and not yet reported finished

    # ---- stop checks ---------------------------------------------------------------
    def finish_reason(self, group: SequenceGroup, seq: Sequence, token: int) -> str | None:
        """Why ``token``, just appended to ``seq``, ends it ("stop" or "length"), or None; decodes its text."""
        reason = self._why_stopped(group, seq, token)
        if reason is None:
            return None
        if reason == "stop_string":  # its text was cut where the stop string starts (or ends, when kept)
            return "stop"
        # a stop token (EOS, stop_token_ids) ends the text without adding its own unless asked, as in vLLM
        params = group.params
        decode_new_text(self.tokenizer, seq, final=True, skip_special_tokens=params.skip_special_tokens,
                        drop_last=reason == "stop_token" and not params.include_stop_str_in_output)
        return "stop" if reason == "stop_token" else reason

    def _why_stopped(self, group: SequenceGroup, seq: Sequence, token: int) -> str | None:
        params = group.params
        may_stop = seq.num_output_tokens >= params.min_tokens
        eos = not params.ignore_eos and token in self.eos_token_ids
        if may_stop and (eos or token in params.stop_token_ids):
            seq.stop_reason = None if eos else token  # as vLLM: EOS is no stop_reason, a stop_token_ids token is
            return "stop_token"
        delta = decode_new_text(self.tokenizer, seq, skip_special_tokens=params.skip_special_tokens)
        if may_stop and params.stop and delta:
            found = find_stop_string(seq.text, len(delta), params.stop)
            if found is not None:
                seq.stop_reason = seq.text[found[0]:found[1]]
                seq.text = seq.text[: found[1] if params.include_stop_str_in_output else found[0]]
                return "stop_string"
        if seq.grammar is not None and seq.grammar.is_complete:  # its structured output is whole: nothing may follow
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- outputs -------------------------------------------------------------------
    def make_outputs(self, groups: list[SequenceGroup]) -> list[RequestOutput]:
        """One output per request (a request listed twice is reported once); finished ones are forgotten."""
        unique = {group.request_id: group for group in groups}
        return [self._output(group) for group in unique.values()]

    def _beam_outputs(self, group: SequenceGroup) -> list[CompletionOutput]:
        skip = group.params.skip_special_tokens
        return [
            CompletionOutput(  # a hypothesis that stopped ends in its EOS token, whose text is left out
                index=i, text=self.tokenizer.decode(h.token_ids[:-1] if h.finish_reason == "stop" else h.token_ids,
                                                    skip_special_tokens=skip), token_ids=h.token_ids,
                finish_reason=h.finish_reason, cumulative_logprob=h.cumulative_logprob,
            )
            for i, h in enumerate(best_hypotheses(group))
        ]

    @staticmethod
    def _reported_text(seq: Sequence, params: SamplingParams) -> str:
        """A sequence's text as reported so far. While it runs, the last characters that could begin a stop string
        are held back (vLLM's stop buffer): a stop string found next cuts the text where it starts, and a stream
        must never have sent what the final text leaves out."""
        if seq.is_finished or not params.stop or params.include_stop_str_in_output:
            return seq.text
        return seq.text[: max(0, len(seq.text) - max(map(len, params.stop)) + 1)]

    def _sample_outputs(self, group: SequenceGroup) -> list[CompletionOutput]:
        want_logprobs = group.params.logprobs is not None
        return [
            CompletionOutput(
                index=i, text=self._reported_text(seq, group.params), token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if want_logprobs else None, cumulative_logprob=seq.cumulative_logprob,
            )
            for i, seq in enumerate(group.seqs)
        ]

    def _output(self, group: SequenceGroup) -> RequestOutput:
        finished = group.is_finished
        if group.params.is_beam_search:  # beams reorder every step: report them once, when final
            outputs = self._beam_outputs(group) if finished else []
        else:
            outputs = self._sample_outputs(group)
        if finished:
            self.groups.pop(group.request_id, None)
        metrics = RequestMetrics(
            group.arrival_time, group.first_scheduled_time, group.first_token_time, group.finished_time)
        prompt_logprobs = list(group.prompt_logprobs) if group.params.prompt_logprobs is not None else None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished, metrics,
                             num_cached_tokens=group.num_cached_tokens or 0, error=group.error, refused=group.refused,
                             prompt_logprobs=prompt_logprobs)
