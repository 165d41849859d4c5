"""Each benchmark runs end to end at minimal scale on the tiny model and writes sane JSON and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import (
    cpu_decode,
    kv_cache_dtype,
    latency,
    linear_layers,
    sampler,
    sharing,
    structured,
    throughput,
    token_budget,
)
from engine.models import cpu_packing


def _argv(model_dir: Path, out: Path) -> list[str]:
    return ["--quick", "--model", str(model_dir), "--dtype", "float32", "--out", str(out)]


def _written(out: Path, name: str) -> dict:
    assert (out / f"{name}.png").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


def test_throughput_reports_every_system_with_ratios(tiny_model_dir: Path, tmp_path: Path) -> None:
    throughput.main(_argv(tiny_model_dir, tmp_path)
                    + ["--systems", "pagedserve", "orca-max", "hf-static", "hf-continuous"])
    systems = _written(tmp_path, "throughput")["systems"]
    assert not [name for name, result in systems.items() if "error" in result]
    base = systems["pagedserve"]["output_tokens_per_s"]
    for name, result in systems.items():  # each baseline's ratio is pagedserve's rate over its own
        assert result["output_tokens_per_s"] > 0
        assert result["pagedserve_speedup"] == pytest.approx(base / result["output_tokens_per_s"])
        assert result["output_tokens"] == systems["pagedserve"]["output_tokens"], name
    for name in ("pagedserve", "orca-max"):
        result = systems[name]
        assert 1 <= result["mean_batch_size"] <= result["peak_batch_size"]
        assert 0 <= result["mean_kv_waste"] < 1
    # reservation holds blocks no token fills yet: more waste than paging
    assert systems["orca-max"]["mean_kv_waste"] > systems["pagedserve"]["mean_kv_waste"]


def test_repeated_rounds_report_each_systems_fastest_round(tiny_model_dir: Path, tmp_path: Path) -> None:
    throughput.main(_argv(tiny_model_dir, tmp_path) + ["--systems", "pagedserve", "orca-max", "--repeat", "2"])
    for result in _written(tmp_path, "throughput")["systems"].values():
        rounds = result["round_output_tokens_per_s"]
        assert len(rounds) == 2 and result["output_tokens_per_s"] == max(rounds)


def test_fastest_round_skips_failed_rounds_and_keeps_an_error_when_all_failed() -> None:
    runs = [{"output_tokens_per_s": 5.0}, {"error": "boom"}, {"output_tokens_per_s": 7.0}]
    assert throughput.fastest_round(runs) == {"output_tokens_per_s": 7.0, "round_output_tokens_per_s": [5.0, None, 7.0]}
    assert throughput.fastest_round([{"error": "a"}, {"error": "b"}]) == {"error": "a"}


def test_repeat_below_one_is_refused() -> None:
    with pytest.raises(SystemExit):
        throughput.parse_args(["--repeat", "0"])


def test_latency_reports_percentiles_per_system_and_rate(tiny_model_dir: Path, tmp_path: Path) -> None:
    latency.main(_argv(tiny_model_dir, tmp_path))
    payload = _written(tmp_path, "latency")
    assert payload["capacity_requests_per_s"] > 0
    assert {row["system"] for row in payload["results"]} == {"pagedserve", "orca-max"}
    for row in payload["results"]:
        assert 0 < row["p50_normalized_latency_s"] <= row["p99_normalized_latency_s"]
        assert 0 < row["p50_ttft_s"] <= row["p99_ttft_s"]


def test_token_budget_steps_more_often_under_a_smaller_budget(tiny_model_dir: Path, tmp_path: Path) -> None:
    payload = token_budget.main(_argv(tiny_model_dir, tmp_path) + ["--budgets", "2048", "64"])
    assert (tmp_path / "token-budget.md").read_text().count("| burst |") == 4  # the medians and every run
    rows = {(row["workload"], row["budget"]): row for row in _written(tmp_path, "token-budget")["rows"]}
    assert set(rows) == {(workload, budget) for workload in token_budget.WORKLOADS for budget in (2048, 64)}
    for row in rows.values():
        assert row["output_tokens_per_s"] > 0 and 0 < row["p50_ttft_s"] <= row["p99_ttft_s"]
        assert 0 < row["p99_step_s"] <= row["max_step_s"]
    assert rows["burst", 2048]["throughput_vs_first"] == 1.0
    # the burst's 4 prompts of 32 tokens fit one 2048-token step, but not one 64-token step
    steps = {run["budget"]: run["num_steps"] for run in payload["runs"] if run["workload"] == "burst"}
    assert steps[64] > steps[2048]


def test_token_budget_below_max_num_seqs_is_refused() -> None:
    with pytest.raises(SystemExit):
        token_budget.parse_args(["--budgets", "2048", "32", "--max-num-seqs", "64"])


def test_sharing_saves_blocks_for_samples_beams_and_prefixes(tiny_model_dir: Path, tmp_path: Path) -> None:
    sharing.main(_argv(tiny_model_dir, tmp_path))
    payload = _written(tmp_path, "sharing")
    assert [row["scenario"] for row in payload["results"]] == ["parallel n=2", "beam width=2", "shared prefix 1-shot"]
    for row in payload["results"]:  # every kind of sharing saves blocks
        assert row["mean_blocks_shared"] < row["mean_blocks_unshared"], row["scenario"]
        shared_fraction = row["mean_blocks_shared"] / row["mean_blocks_unshared"]
        assert row["saving_percent"] == pytest.approx(100 * (1 - shared_fraction))
    prefix_rows = [row for row in payload["results"] if row["scenario"].startswith("shared prefix")]
    assert all(row["prefix_cache_hit_rate"] > 0 for row in prefix_rows)


def test_cpu_decode_pairs_both_attention_backends_on_the_same_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    cpu_decode.main(["--model", str(tiny_model_dir), "--rows", "3", "--contexts", "20", "--steps", "2",
                     "--out", str(tmp_path)])
    (result,) = _written(tmp_path, "cpu-decode")["results"]
    assert (result["rows"], result["context"]) == (3, 20)
    assert result["same_tokens"] is True
    assert result["speedup"] == pytest.approx(result["torch_ms"] / result["cpu_ms"])


def test_structured_times_every_constraint_against_the_unconstrained_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    structured.main(["--model", str(tiny_model_dir), "--rows", "3", "--prompt-tokens", "12", "--steps", "2",
                     "--out", str(tmp_path)])
    results = _written(tmp_path, "structured")["results"]
    assert [r["constraint"] for r in results] == list(structured.CONSTRAINTS)
    none = results[0]
    assert none["vs_none"] == 1.0
    assert all(r["rows"] == r["running_at_end"] == 3 and r["fastest_ms"] > 0 for r in results)
    for row in results[1:]:
        assert row["vs_none"] == pytest.approx(row["fastest_ms"] / none["fastest_ms"])


def test_linear_layers_times_every_layout_against_the_baseline(tiny_model_dir: Path, tmp_path: Path) -> None:
    linear_layers.main(["--model", str(tiny_model_dir), "--rows", "1", "3", "--repeats", "2", "--out", str(tmp_path)])
    payload = _written(tmp_path, "linear-layers")
    baseline, layouts = payload["baseline"], payload["layouts"]
    assert baseline in layouts and "onednn" in layouts
    assert ("fp16" in layouts) == cpu_packing.fp16_kernel_applies()
    assert [result["rows"] for result in payload["results"]] == [1, 3]
    for result in payload["results"]:
        for layout in layouts:
            assert result[f"{layout}_ms"] > 0
            if layout != baseline:
                assert result[f"{layout}_over_{baseline}"] == pytest.approx(result[f"{layout}_ms"]
                                                                          / result[f"{baseline}_ms"])


@pytest.mark.skipif(not (cpu_packing.fp16_kernel_applies() or cpu_packing.bf16_kernel_applies()),
                    reason="no kernel of ours runs fp32 or bf16 linears here")
def test_linear_layers_times_a_revisions_build_of_our_kernel_beside_the_working_trees(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    dtype, ours = ("bfloat16", "bf16") if cpu_packing.bf16_kernel_applies() else ("float32", "fp16")
    linear_layers.main(["--model", str(tiny_model_dir), "--dtype", dtype, "--rows", "2", "--repeats", "2",
                        "--base", "HEAD", "--baseline", f"{ours}@base", "--out", str(tmp_path)])
    payload = _written(tmp_path, "linear-layers")
    # fp32 has fbgemm's fp16 layout too, between ours and the revision's
    assert payload["layouts"][0] == ours and f"{ours}@base" in payload["layouts"] and len(payload["base_commit"]) == 40
    (result,) = payload["results"]
    assert result[f"{ours}_over_{ours}@base"] == pytest.approx(result[f"{ours}_ms"] / result[f"{ours}@base_ms"])


def test_linear_layers_refuses_a_baseline_the_machine_lacks(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--baseline must be one of"):
        linear_layers.main(["--model", str(tiny_model_dir), "--baseline", "nope", "--out", str(tmp_path)])


def test_sampler_times_both_ways_and_compares_their_tokens(tmp_path: Path) -> None:
    sampler.main(["--rows", "1", "3", "--params", "temperature 1", "top-p 0.95", "--vocab", "600", "--repeats", "2",
                  "--out", str(tmp_path)])
    payload = _written(tmp_path, "sampler")
    assert [(r["rows"], r["params"]) for r in payload["results"]] == [
        (1, "temperature 1"), (1, "top-p 0.95"), (3, "temperature 1"), (3, "top-p 0.95")]
    for result in payload["results"]:
        assert result["torch_ms"] > 0 and result["compiled_ms"] > 0 and result["same_tokens"] is True
        assert result["compiled_over_torch"] == pytest.approx(result["compiled_ms"] / result["torch_ms"])


@pytest.mark.parametrize(("flags", "named"), [(["--rows", "0"], "--rows"), (["--vocab", "0"], "--vocab"),
                                              (["--scale", "0"], "--scale"), (["--params", "nucleus"], "--params")])
def test_sampler_refuses_bad_arguments_naming_the_flag(flags: list[str], named: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sampler.main(flags)
    assert named in capsys.readouterr().err


def test_kv_cache_dtype_measures_each_cache_against_exact_fp32(tiny_model_dir: Path, tmp_path: Path) -> None:
    kv_cache_dtype.main(["--model", str(tiny_model_dir), "--max-tokens", "3", "--out", str(tmp_path), "--name", "kv"])
    rows = {row["variant"]: row for row in _written(tmp_path, "kv")["rows"]}
    assert [row["cache dtype"] for row in rows.values()] == ["float32", "float32", "float16", "bfloat16"]
    assert rows["exact"]["mean |log-prob change|"] == 0 and rows["exact"]["greedy agreement"] == 1
    # the fp16 weights change the text's log-probs; no cache here is exact
    assert all(row["mean |log-prob change|"] > 0 for name, row in rows.items() if name != "exact")
