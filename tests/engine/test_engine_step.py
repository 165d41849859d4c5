"""An engine step's hand-offs: observers see every scheduled step, with the block tables the runner reads."""

from __future__ import annotations

from pathlib import Path

from engine import LLM, SamplingParams
from engine.scheduler import SchedulerOutput
from engine.utils import cdiv


def test_step_observers_see_every_step_with_the_block_tables_of_its_sequences(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8)
    engine = llm.engine
    seen: list[SchedulerOutput] = []

    def observe(out: SchedulerOutput) -> None:
        for item in out.scheduled:  # the tables as scheduled, covering every token the step computes
            assert item.block_table == engine.block_manager.tables[item.seq.seq_id]
            needed = cdiv(item.seq.num_computed_tokens + item.num_new_tokens, engine.config.block_size)
            assert len(item.block_table) >= needed
        seen.append(out)

    engine.step_observers.append(observe)
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    outputs = llm.generate(["The quick brown fox jumps", "Hello"], params, use_tqdm=False)
    assert all(len(c.token_ids) == 6 for out in outputs for c in out.outputs)
    non_empty = [out for out in seen if not out.is_empty]
    assert len(non_empty) == llm.stats().num_steps == 6  # one prefill step, then five decode steps
    assert [len(out.scheduled) for out in non_empty] == [2] + [4] * 5  # each prompt forks into its 2 samples
