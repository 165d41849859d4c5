"""The serving benchmark: guidellm against a real `pagedserve up` on the tiny model; llama.cpp's half through its
pure pieces (llama.cpp itself takes ~10 minutes to build, so no test builds it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import guidellm_client, serve
from benchmarks.baselines import llama_cpp
from benchmarks.guidellm_client import Target, Workload

NUM_REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 16, 8
SMALL_ENGINE = "--dtype float32 --kv-cache-memory 32MiB --swap-space 32MiB --max-num-seqs 8"


def _pagedserve_argv(model_dir: Path, out: Path, pagedserve_flags: str, systems: tuple[str, ...] = ("pagedserve",)
                     ) -> list[str]:
    return ["--systems", *systems, "--model", str(model_dir), "--requests", str(NUM_REQUESTS),
            "--concurrency", "2", "--prompt-tokens", str(PROMPT_TOKENS), "--output-tokens", str(OUTPUT_TOKENS),
            "--pagedserve-flags", pagedserve_flags, "--out", str(out)]


def test_guidellm_measures_pagedserve_up_streaming_and_not(tiny_model_dir: Path, tmp_path: Path) -> None:
    serve.main(_pagedserve_argv(tiny_model_dir, tmp_path, SMALL_ENGINE, systems=("pagedserve", "offline")))
    payload = json.loads((tmp_path / "serve.json").read_text())
    assert [(row["system"], row["mode"], row["concurrency"]) for row in payload["rows"]] == [
        ("pagedserve", "non-streaming", 2), ("pagedserve", "streaming", 2), ("offline", "offline", 2)]
    for row in payload["rows"]:
        assert "error" not in row, row["error"]
        assert row["requests_successful"] == NUM_REQUESTS and row["requests_failed"] == 0
        assert row["output_tokens"] == NUM_REQUESTS * OUTPUT_TOKENS  # EOS ignored: every request makes them all
        assert row["output_tokens_per_s"] > 0
    # each run drew prompts of its own, so the second did not meet the first's in the server's prefix cache
    assert payload["rows"][0]["prompt_seed"] != payload["rows"][1]["prompt_seed"]
    assert "each run its own prompts" in (tmp_path / "serve.md").read_text()
    for row in payload["rows"][:2]:
        assert 0 < row["latency_ms_p50"] <= row["latency_ms_p99"]
        # the worker's step counters over the run: every token came from a step of 1 or 2 rows (2 in flight)
        assert NUM_REQUESTS * OUTPUT_TOKENS // 2 <= row["engine_steps"] <= NUM_REQUESTS * OUTPUT_TOKENS
        assert 1.0 <= row["engine_rows_per_step"] <= 2.0
        assert 0 < row["engine_busy_s"] <= row["duration_s"] and "engine_counters_error" not in row
        # each process of the service took CPU for the run's tokens: the worker's engine, the API answering every
        # request, Redis carrying the messages and token streams
        assert all(row[f"{role}_cpu_ms_per_token"] > 0 for role in serve.SERVICE_ROLES), row
    streaming, offline = payload["rows"][1:]
    assert offline["config"] == "engine, max_num_seqs=2"
    assert 0 < streaming["ttft_ms_p50"] <= streaming["ttft_ms_p99"] and streaming["itl_ms_p50"] > 0
    assert "ttft_ms_p50" not in payload["rows"][0]  # whole responses have no first-token time
    assert payload["machine"]["cpu_model"] and isinstance(payload["machine"]["cpu_flags"], list)
    assert [c["pagedserve_output_tokens_per_s"] for c in payload["comparisons"]] == [
        row["output_tokens_per_s"] for row in payload["rows"][:2]]
    for comparison in payload["comparisons"]:  # the service's share of the engine at the same concurrency
        assert comparison["pagedserve_over_offline"] == pytest.approx(
            comparison["pagedserve_output_tokens_per_s"] / offline["output_tokens_per_s"])
    assert "| pagedserve |" in (tmp_path / "serve.md").read_text()
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_a_worker_whose_metrics_do_not_answer_leaves_the_run_measured_without_engine_counters() -> None:
    row: dict[str, object] = {"output_tokens_per_s": 10.0}
    assert serve.engine_counters("http://127.0.0.1:1/metrics", row) is None  # nothing listens on port 1
    assert "127.0.0.1:1" in str(row["engine_counters_error"]) and row["output_tokens_per_s"] == 10.0
    counters = dict.fromkeys(serve.ENGINE_COUNTERS, 0.0)
    assert serve.engine_share(counters, counters, duration_s=0.0) == {
        "engine_busy_s": 0.0, "engine_busy_share": 0.0, "engine_steps": 0, "engine_rows_per_step": 0.0}


def test_pagedserve_that_cannot_start_is_an_error_row_with_its_log(tiny_model_dir: Path, tmp_path: Path) -> None:
    payload = serve.main(_pagedserve_argv(tiny_model_dir, tmp_path, "--max-num-seqs 0"))
    (row,) = payload["rows"]
    assert "pagedserve up exited" in row["error"] and "--max-num-seqs" in row["error"]
    assert payload["comparisons"] == []


def test_guidellm_runs_offline_on_the_fixed_workload_at_the_asked_concurrency(tmp_path: Path) -> None:
    target = Target("http://127.0.0.1:8000", "smollm2", api_key="psk_x")
    command = guidellm_client.command(target, tmp_path, Workload(96, 128, 64), stream=True, concurrency=32,
                                      report_path=tmp_path / "r.json")
    options = dict(zip(command[4::2], command[5::2], strict=False))  # after `python -m guidellm run`
    assert options["--profile"] == "kind=concurrent,streams=32"
    assert options["--constraint"] == "kind=max_requests,count=96"
    assert options["--data"] == "kind=synthetic_text,prompt_tokens=128,output_tokens=64"
    # the data worker prepares the run's prompts, not guidellm's default 4,096, while the server is measured
    assert options["--data-loader"] == "kind=pytorch,prefetch_factor=96"
    assert options["--tokenizer"] == f"kind=hf_auto,model={tmp_path}"  # a local folder: nothing downloads
    assert "stream=true" in options["--backend"] and "api_key=psk_x" in options["--backend"]
    assert options["--seed"] == "kind=static,value=42"  # guidellm's default prompts unless a seed is given
    seeded = guidellm_client.command(target, tmp_path, Workload(96, 128, 64), stream=True, concurrency=32,
                                     report_path=tmp_path / "r.json", prompt_seed=7)
    assert dict(zip(seeded[4::2], seeded[5::2], strict=False))["--seed"] == "kind=static,value=7"
    environment = guidellm_client.environment(client_processes=1)
    assert environment["HF_HUB_OFFLINE"] == "1" and environment["GUIDELLM__MAX_WORKER_PROCESSES"] == "1"


def test_llama_server_pool_holds_every_slots_request_with_slack() -> None:
    kv_tokens = serve.llama_cpp_kv_tokens(16, Workload(96, 128, 128))
    assert kv_tokens == 16 * (128 + 128 + serve.SLOT_SLACK_TOKENS)


def test_llama_cpp_best_is_the_fastest_configuration_whose_requests_all_succeeded() -> None:
    cell = {"mode": "streaming", "concurrency": 32}
    rows = [
        {"system": "pagedserve", "config": "defaults", **cell, "output_tokens_per_s": 100.0, "requests_failed": 0},
        {"system": "llama.cpp", "config": "BF16 GGUF, 16 slots", **cell, "output_tokens_per_s": 80.0,
         "requests_failed": 0},
        {"system": "llama.cpp", "config": "Q8_0 GGUF, 32 slots", **cell, "output_tokens_per_s": 120.0,
         "requests_failed": 1},
        {"system": "llama.cpp", "config": "F32 GGUF, 8 slots", "error": "llama-server exited with 1 at start"},
    ]
    (comparison,) = serve.comparisons(rows)
    assert comparison["llama_cpp_best_config"] == "BF16 GGUF, 16 slots"
    assert comparison["pagedserve_over_llama_cpp"] == pytest.approx(100.0 / 80.0)


def test_rounds_repeat_the_matrix_and_record_their_number(tiny_model_dir: Path, tmp_path: Path) -> None:
    payload = serve.main([*_pagedserve_argv(tiny_model_dir, tmp_path, SMALL_ENGINE, systems=("offline",)),
                          "--rounds", "2"])
    assert [(row["system"], row["round"]) for row in payload["rows"]] == [("offline", 1), ("offline", 2)]
    assert "| round |" in (tmp_path / "serve.md").read_text()


def test_every_run_draws_prompts_of_its_own_unless_prompts_repeat() -> None:
    cells = [(round_number, mode, concurrency) for round_number in (1, 2) for mode in serve.MODES
             for concurrency in (1, 4, 16, 100)]
    fresh = serve.parse_args([])
    assert len({serve.prompt_seed(fresh, *cell) for cell in cells}) == len(cells)
    repeated = serve.parse_args(["--repeat-prompts"])
    assert {serve.prompt_seed(repeated, *cell) for cell in cells} == {guidellm_client.DEFAULT_PROMPT_SEED}
    assert serve.workload(repeated).repeat_prompts and not serve.workload(fresh).repeat_prompts


def test_each_systems_fastest_round_is_compared() -> None:
    runs = [("pagedserve", 1, 100.0), ("offline", 1, 200.0), ("pagedserve", 2, 150.0), ("offline", 2, 180.0)]
    rows = [{"system": system, "round": round_number, "mode": "offline" if system == "offline" else "non-streaming",
             "concurrency": 8, "output_tokens_per_s": tokens_per_s, "requests_failed": 0}
            for system, round_number, tokens_per_s in runs]
    (comparison,) = serve.comparisons(rows)
    assert comparison["pagedserve_output_tokens_per_s"] == 150.0 and comparison["offline_output_tokens_per_s"] == 200.0
    assert comparison["pagedserve_over_offline"] == pytest.approx(0.75)


def test_unknown_gguf_type_is_refused_naming_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outtype must be one of f32, f16, bf16, q8_0, got 'q4_0'"):
        llama_cpp.ensure_gguf(tmp_path, cache_dir=tmp_path, outtype="q4_0")


@pytest.mark.parametrize("argv, named", [(["--concurrency", "0"], "--concurrency"),
                                         (["--gguf-types", "q4_0"], "--gguf-types"),
                                         (["--modes", "batch"], "--modes")])
def test_bad_options_are_refused_naming_the_option(argv: list[str], named: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serve.parse_args(argv)
    assert named in capsys.readouterr().err


def test_keep_others_keeps_the_other_systems_runs_of_the_same_workload(tmp_path: Path) -> None:
    workload = {"num_requests": 96, "prompt_tokens": 128, "output_tokens": 128, "repeat_prompts": False}
    earlier = {"command": "python -m benchmarks.serve", "workload": workload,
               "rows": [{"system": "pagedserve", "config": "defaults"}, {"system": "llama.cpp", "config": "x"}],
               "llama_cpp": {"sdist": "llama_cpp_python-0.3.36.tar.gz", "commit": "abc"}}
    (tmp_path / "serve.json").write_text(json.dumps(earlier))
    args = serve.parse_args(["--systems", "pagedserve", "--keep-others", "--out", str(tmp_path)])
    assert serve.earlier_runs(args) == ("python -m benchmarks.serve", [{"system": "llama.cpp", "config": "x"}],
                                        earlier["llama_cpp"])
    with pytest.raises(SystemExit, match="measured another workload"):
        serve.earlier_runs(serve.parse_args(["--systems", "pagedserve", "--requests", "8", "--out", str(tmp_path)]))
    with pytest.raises(SystemExit, match="measured another workload"):
        serve.earlier_runs(serve.parse_args(["--systems", "pagedserve", "--repeat-prompts", "--out", str(tmp_path)]))
    # a file from before prompts were drawn per run sent every run the same ones
    old_file = {**earlier, "workload": {k: v for k, v in workload.items() if k != "repeat_prompts"}}
    (tmp_path / "serve.json").write_text(json.dumps(old_file))
    assert serve.earlier_runs(serve.parse_args(["--systems", "pagedserve", "--keep-others", "--repeat-prompts",
                                                "--out", str(tmp_path)]))[1] == [{"system": "llama.cpp", "config": "x"}]


def test_kept_llama_cpp_runs_keep_the_source_they_ran(tiny_model_dir: Path, tmp_path: Path) -> None:
    # re-measuring pagedserve alone against llama.cpp's recorded runs needs no llama.cpp build on this machine
    source = {"sdist": "llama_cpp_python-0.3.36.tar.gz", "commit": "abc"}
    kept = {"system": "llama.cpp", "config": "BF16 GGUF, 16 slots", "mode": "non-streaming", "concurrency": 2,
            "output_tokens_per_s": 80.0, "requests_failed": 0}
    workload = {"num_requests": NUM_REQUESTS, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                "repeat_prompts": False}
    (tmp_path / "serve.json").write_text(json.dumps({"command": "python -m benchmarks.serve", "workload": workload,
                                                     "rows": [kept], "llama_cpp": source}))
    payload = serve.main([*_pagedserve_argv(tiny_model_dir, tmp_path, SMALL_ENGINE, systems=("offline",)),
                          "--keep-others"])
    assert [row["system"] for row in payload["rows"]] == ["llama.cpp", "offline"]
    assert payload["llama_cpp"] == source


def test_offline_engine_samples_as_the_service_samples_guidellms_requests() -> None:
    # guidellm's requests name no sampling parameter: the OpenAI endpoints' defaults apply to them, and the offline
    # ceiling must sample the same way (a greedy ceiling skips the sampler's work and flatters the engine)
    from api.openai_schemas import OpenAIRequest
    from benchmarks.serve_offline import service_default_sampling

    sampling = service_default_sampling()
    assert sampling["temperature"] > 0
    assert sampling == {name: OpenAIRequest.model_fields[name].default for name in sampling}
