"""Shared fixtures: a tiny random Llama with the default model's tokenizer, and the real model."""

from __future__ import annotations

from pathlib import Path

import pytest

# The only tests that may skip: those marked as needing hardware this machine may lack.
HARDWARE_MARKERS = ("gpu", "onednn_bf16", "avx512_bf16", "avx512_vnni", "fbgemm_fp16", "x86_builds")

TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, initializer_range=0.2,
)


def tiny_block_bytes(**engine_kwargs: object) -> int:
    """Bytes of one KV block of the tiny Llama (K and V, 2 layers, 2 KV heads of 16 dims; 16 tokens unless
    ``block_size`` says) in the dtype an engine of ``engine_kwargs`` gives its cache: an fp32 model's cache is fp16
    where the CPU holds its weights in fp16 (``EngineConfig.kv_cache_dtype``), fp32 on CUDA, so that a budget of N
    blocks is N blocks on every machine."""
    from engine.cache_engine import kv_block_bytes
    from engine.config import EngineConfig

    config = EngineConfig(**engine_kwargs)  # type: ignore[arg-type]
    return kv_block_bytes(TINY_LLAMA["num_hidden_layers"], config.block_size, TINY_LLAMA["num_key_value_heads"],
                          TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"], config.kv_cache_torch_dtype())


def build_tiny_llama(folder: Path, seed: int = 0, **overrides: object) -> Path:
    """Save a randomly initialised tiny Llama (SmolLM2's tokenizer and vocabulary) into ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model_files import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        **{**TINY_LLAMA, **overrides},
    )
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tiny random Llama (2 layers, GQA 4/2) and the SmolLM2 tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model converted to safetensors (converted once into the cache dir)."""
    from engine.model_files import resolve_model

    return resolve_model("smollm2-135m-instruct")


class SkipGuard:
    """Fails the run when a test skipped that is not marked as needing missing hardware.

    A missing dependency (Triton, Prometheus, a database server) must not turn into a green run with
    fewer tests in it."""

    def __init__(self) -> None:
        self.unexpected: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):  # an xfail reports as skipped too
            if not any(marker in report.keywords for marker in HARDWARE_MARKERS):
                self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:  # a whole module skipped, e.g. by pytest.importorskip
            self._record(report)

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        self.unexpected.append(f"{report.nodeid}: {reason}")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.unexpected:
            terminalreporter.section("skipped tests that must run here", red=True)
            for line in self.unexpected:
                terminalreporter.line(line)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipGuard(), "pagedserve-skip-guard")
