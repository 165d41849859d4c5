"""`vllm serve` flags that have no effect on pagedserve, accepted by the server commands so that a vLLM command
line starts pagedserve unchanged; the ones given are named, with the reason, in one warning at start.

Flags that do something here are settings (`cli.flags`), under vLLM's names where they overlap."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger("pagedserve.cli")
NO_DOWNLOADS = "nothing is downloaded: the model is a built-in name, a local folder or a GGUF file"

# flag -> (whether it takes a value, why it has no effect here); a flag without a value also has its --no- form
FLAGS_WITHOUT_EFFECT: dict[str, tuple[bool, str]] = {
    "--disable-log-requests": (False, "request bodies are never logged; jobs log their state changes"),
    "--enable-log-requests": (False, "request bodies are never logged; jobs log their state changes"),
    "--disable-log-stats": (False, "engine stats are Prometheus metrics, not log lines"),
    "--uvicorn-log-level": (True, "the API logs through pagedserve's logging (--log-format)"),
    "--disable-uvicorn-access-log": (False, "the API logs each request's job, not an access log"),
    "--trust-remote-code": (False, "no code from a model's folder is ever run"),
    "--generation-config": (True, "sampling defaults are the request's, as `--generation-config vllm`"),
    "--enable-chunked-prefill": (False, "long prompts are always prefilled in chunks of --max-num-batched-tokens"),
    "--max-logprobs": (True, "requests may ask for up to 20 logprobs per token, vLLM's default"),
    "--download-dir": (True, NO_DOWNLOADS),
    "--revision": (True, NO_DOWNLOADS),
    "--code-revision": (True, NO_DOWNLOADS),
    "--tokenizer-revision": (True, NO_DOWNLOADS),
    "--load-format": (True, "weights are read as found: safetensors in a folder, or a GGUF file"),
    "--tokenizer-mode": (True, "the model's fast tokenizer is used"),
    "--disable-frontend-multiprocessing": (False, "the API always runs apart from the engine, in its own process"),
    "--distributed-executor-backend": (True, "one worker process runs one engine"),
    "--guided-decoding-backend": (True, "structured outputs always use llguidance"),
    "--scheduling-policy": (True, "jobs are scheduled by priority (equal priorities first come, first served)"),
    "--enable-prompt-tokens-details": (False, "usage always has prompt_tokens_details.cached_tokens"),
    "--enable-force-include-usage": (False, "usage comes with stream_options.include_usage, as OpenAI's"),
    "--response-role": (True, "a chat answer's role is assistant"),
    "--chat-template-content-format": (True, "a message's text parts reach the chat template joined as text"),
    "--max-seq-len-to-capture": (True, "CUDA graphs are captured for decode batches (--cuda-graph-max-batch)"),
    "--disable-custom-all-reduce": (False, "one worker's model spans one device"),
}


def _dest(flag: str) -> str:
    return "vllm_" + flag.removeprefix("--").replace("-", "_")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Accept the flags without effect on a server command."""
    group = parser.add_argument_group("vLLM flags accepted without effect (a warning names the ones given)")
    for flag, (takes_value, reason) in FLAGS_WITHOUT_EFFECT.items():
        if takes_value:
            group.add_argument(flag, dest=_dest(flag), metavar="VALUE", help=f"no effect: {reason}")
        else:
            group.add_argument(flag, dest=_dest(flag), action=argparse.BooleanOptionalAction, default=None,
                               help=f"no effect: {reason}")


def given_without_effect(args: argparse.Namespace) -> list[str]:
    """The flags without effect that a command line gave."""
    return [flag for flag in FLAGS_WITHOUT_EFFECT if getattr(args, _dest(flag), None) is not None]


def warn_without_effect(args: argparse.Namespace) -> None:
    """One warning naming each flag without effect that was given, and why it has none."""
    given = given_without_effect(args)
    if given:
        reasons = "; ".join(f"{flag}: {FLAGS_WITHOUT_EFFECT[flag][1]}" for flag in given)
        logger.warning("cli.vllm_flags_without_effect flags=%s why=%s", ",".join(given), reasons)
