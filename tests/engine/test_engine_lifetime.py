"""An engine is freed as soon as its last reference goes: none of its parts refers back to it.

The KV cache is sized from the memory free when an engine starts, so an engine that waited for a
cyclic garbage collection kept gigabytes, and the next engine built in that process found little free.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from engine import LLM, SamplingParams


def test_an_engine_and_its_kv_cache_are_freed_when_the_llm_is_dropped(tiny_model_dir: Path) -> None:
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # only reference counting may free it
    try:
        llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8)
        params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)
        llm.generate(["The quick brown fox jumps", "Hello"], params, use_tqdm=False)
        engine = weakref.ref(llm.engine)
        kv_cache = weakref.ref(llm.engine.cache.gpu_kv)
        model = weakref.ref(llm.engine.model)
        del llm
        assert engine() is None
        assert kv_cache() is None
        assert model() is None
    finally:
        if was_enabled:
            gc.enable()
