"""`pagedserve` flags: vLLM's names and meanings, each command's own flags in --help, startup checks naming the flag."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import get_args

import pytest

from cli import main as cli
from cli.flags import API_ONLY, WORKER_ONLY
from cli.vllm_flags import FLAGS_WITHOUT_EFFECT, given_without_effect, warn_without_effect
from core.settings import Settings, configure, get_settings
from engine.config import DTYPE_NAMES
from worker.service import engine_kwargs


@pytest.fixture(autouse=True)
def _restore_settings() -> Iterator[None]:
    yield
    configure(None)


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """stderr of a command that must refuse to start."""
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    message = str(exited.value.code) if isinstance(exited.value.code, str) else capsys.readouterr().err
    assert exited.value.code != 0, message
    return message


def _settings(*argv: str) -> Settings:
    return cli.settings_from(cli._parser().parse_args(list(argv)))


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"pagedserve {version('pagedserve')}"


def test_each_command_shows_only_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    api, worker, up = (_help(capsys, command) for command in ("api", "worker", "up"))
    assert "--served-model-name" in api and "--chat-template" in api and "--swap-space" not in api
    assert "--swap-space" in worker and "--seed" in worker and "--served-model-name" not in worker
    assert all(flag in up for flag in ("--served-model-name", "--swap-space", "--max-model-len", "--tokenizer"))
    submit, migrate = _help(capsys, "submit"), _help(capsys, "migrate")
    assert "--port" in submit and "--model" not in submit and "--redis-url" not in submit
    assert "--database-url" in migrate and "--model" not in migrate


def test_help_shows_types_choices_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help(capsys, "worker").split())
    assert "--preemption-mode {swap,recompute}" in text and "--max-model-len INT" in text
    assert "--gpu-memory-utilization FLOAT" in text and "(default: 0.9)" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text and "(default: 4.0GiB)" in text


def test_the_api_only_and_worker_only_lists_name_distinct_settings() -> None:
    assert not API_ONLY & WORKER_ONLY
    assert (API_ONLY | WORKER_ONLY) <= set(Settings.model_fields)


@pytest.mark.parametrize(("given", "expected_bytes"), [("4", 4 << 30), ("0.5", 1 << 29), ("512MiB", 512 << 20)])
def test_swap_space_is_gib_when_a_bare_number(given: str, expected_bytes: int) -> None:
    assert _settings("worker", "--swap-space", given).swap_space == expected_bytes


def test_default_swap_space_is_4_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_SWAP_SPACE", raising=False)
    assert Settings().swap_space == 4 << 30


def test_swap_space_from_the_environment_is_gib_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_SWAP_SPACE", "2")
    assert Settings().swap_space == 2 << 30


def test_settings_reach_a_child_process_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings("up", "--swap-space", "3", "--served-model-name", "a", "b", "--no-enable-prefix-caching")
    for name, value in cli.settings_env(settings).items():
        if name.startswith("PAGEDSERVE_"):
            monkeypatch.setenv(name, value)
    assert Settings() == settings


def test_vllm_engine_flags_reach_the_engine(tiny_model_dir: Path) -> None:
    from engine.config import EngineConfig

    settings = _settings("worker", "--model", str(tiny_model_dir), "--max-model-len", "64", "--seed", "7",
                         "--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "512",
                         "--no-enable-prefix-caching", "--tokenizer", str(tiny_model_dir), "--swap-space", "1",
                         "--enforce-eager", "--cuda-graph-max-batch", "32", "--kv-cache-dtype", "bf16")
    config = EngineConfig(**engine_kwargs(settings))
    assert config.kv_cache_dtype == "bf16"
    assert (config.enforce_eager, config.cuda_graph_max_batch) == (True, 32)
    assert (config.max_model_len, config.seed, config.gpu_memory_utilization) == (64, 7, 0.5)
    assert (config.max_num_batched_tokens, config.enable_prefix_caching) == (512, False)
    assert (config.tokenizer, config.swap_space) == (str(tiny_model_dir), 1 << 30)


@pytest.mark.parametrize(("argv", "flag"), [
    (["worker", "--swap-space", "4 parsecs"], "--swap-space"),
    (["worker", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["worker", "--max-model-len", "0"], "--max-model-len"),
    (["worker", "--max-model-len", "many"], "--max-model-len"),
    (["worker", "--preemption-mode", "pause"], "--preemption-mode"),
    (["worker", "--dtype", "float8"], "--dtype"),
    (["worker", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
    (["worker", "--cuda-graph-max-batch", "0"], "--cuda-graph-max-batch"),
    (["api", "--tokenizer", "/nonexistent/tokenizer"], "--tokenizer"),
    (["api", "--served-model-name"], "--served-model-name"),
    (["api", "--served-model-name", ""], "--served-model-name"),
    (["api", "--port", "70000"], "--port"),
    (["up", "--port", "-1"], "--port"),
    (["worker", "--metrics-port", "99999"], "--metrics-port"),
    (["worker", "--swap-space", "inf"], "--swap-space"),
    (["worker", "--webhook-timeout-s", "inf"], "--webhook-timeout-s"),
    (["worker", "--heartbeat-ttl-s", "nan"], "--heartbeat-ttl-s"),
    (["worker", "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["submit-file", "jobs.jsonl", "--retry-for", "nan"], "--retry-for"),
])
def test_a_bad_flag_value_fails_at_startup_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    assert flag in _refused(capsys, *argv)


@pytest.mark.parametrize("setting", ["dtype", "kv_cache_dtype"])
def test_the_dtype_settings_accept_exactly_the_engines_names(setting: str) -> None:
    assert set(get_args(Settings.model_fields[setting].annotation)) == set(DTYPE_NAMES)


def test_a_bad_enforce_eager_in_the_environment_fails_at_startup_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_ENFORCE_EAGER", "perhaps")
    message = _refused(capsys, "worker")
    assert "--enforce-eager (PAGEDSERVE_ENFORCE_EAGER)" in message


def test_graphs_are_captured_unless_enforce_eager_is_given() -> None:
    assert engine_kwargs(_settings("worker"))["enforce_eager"] is False
    assert engine_kwargs(_settings("up", "--enforce-eager"))["enforce_eager"] is True


@pytest.fixture
def busy_port() -> Iterator[str]:
    """A port something listens on: an API that got past its startup checks fails to bind it instead of serving."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield str(server.getsockname()[1])


def test_a_context_longer_than_the_models_fails_at_startup(
    capsys: pytest.CaptureFixture[str], api_model_dir: Path, busy_port: str
) -> None:
    message = _refused(capsys, "api", "--model", str(api_model_dir), "--max-model-len", "4096", "--port", busy_port)
    assert "--max-model-len" in message and "128" in message


def test_a_broken_chat_template_fails_at_startup(
    capsys: pytest.CaptureFixture[str], api_model_dir: Path, busy_port: str
) -> None:
    message = _refused(capsys, "api", "--model", str(api_model_dir), "--chat-template", "{% for m in %}",
                       "--port", busy_port)
    assert "--chat-template" in message


def test_a_chat_template_file_replaces_the_models(tmp_path: Path, api_model_dir: Path) -> None:
    from api.prompts import prompt_model

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    _settings("api", "--model", str(api_model_dir), "--chat-template", str(template))
    assert prompt_model().render_chat([{"role": "user", "content": "the fox"}]) == "the fox"


def test_an_engine_limit_fails_the_worker_at_startup(tiny_model_dir: Path) -> None:
    settings = _settings("worker", "--model", str(tiny_model_dir), "--max-num-seqs", "16",
                         "--max-num-batched-tokens", "8")
    with pytest.raises(SystemExit, match="max_num_batched_tokens"):
        cli.check_startup(settings, "worker")


def test_a_kv_cache_dtype_the_model_cannot_take_fails_the_worker_at_startup(tiny_model_dir: Path) -> None:
    settings = _settings("worker", "--model", str(tiny_model_dir), "--dtype", "bfloat16", "--kv-cache-dtype", "fp16")
    with pytest.raises(SystemExit, match="pagedserve worker: kv_cache_dtype must be the model's dtype"):
        cli.check_startup(settings, "worker")


def test_a_kv_cache_budget_below_two_blocks_fails_the_worker_at_startup(tiny_model_dir: Path) -> None:
    settings = _settings("worker", "--model", str(tiny_model_dir), "--kv-cache-memory", "1KiB")
    with pytest.raises(SystemExit, match="pagedserve worker: kv_cache_memory of 1024 bytes holds 0 blocks"):
        cli.check_startup(settings, "worker")


def test_served_model_names_travel_as_json(tiny_model_dir: Path) -> None:
    env = cli.settings_env(_settings("up", "--served-model-name", "a", "b c"))
    assert json.loads(env["PAGEDSERVE_SERVED_MODEL_NAME"]) == ["a", "b c"]


def test_served_model_names_from_the_environment_may_be_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_SERVED_MODEL_NAME", "tiny, tiny-chat")
    assert Settings().served_model_name == ["tiny", "tiny-chat"]


def test_a_swap_space_set_by_model_copy_reaches_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    copied = Settings().model_copy(update={"swap_space": "1MiB"})  # model_copy does not validate
    monkeypatch.setenv("PAGEDSERVE_SWAP_SPACE", cli.settings_env(copied)["PAGEDSERVE_SWAP_SPACE"])
    assert Settings().swap_space == 1 << 20


def test_an_unknown_pagedserve_variable_is_named_in_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PAGEDSERVE_WEBHOOK_SECRET", "removed-setting")  # per-key secrets replaced it
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQ", "8")  # misspelt max_num_seqs
    configure(None)
    with caplog.at_level("WARNING", logger="pagedserve.settings"):
        get_settings()
    configure(None)
    assert [r.getMessage() for r in caplog.records] == [
        "settings.unknown_environment names=PAGEDSERVE_MAX_NUM_SEQ,PAGEDSERVE_WEBHOOK_SECRET: not read by any setting"
    ]


def test_the_model_may_be_given_first_as_in_vllm_serve(capsys: pytest.CaptureFixture[str]) -> None:
    assert _settings("up", "my-model", "--port", "9").model == "my-model"
    assert _settings("worker", "my-model", "--model", "my-model").model == "my-model"
    assert _settings("api").model == Settings().model
    assert "the model is given twice: 'a' and --model 'b'" in _refused(capsys, "up", "a", "--model", "b")


def test_tensor_parallel_size_takes_one_device_per_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert _settings("worker", "--tensor-parallel-size", "1").tensor_parallel_size == 1
    assert _settings("api", "m", "--tensor-parallel-size", "1").tensor_parallel_size == 1  # as `vllm serve` takes it
    assert "--tensor-parallel-size (PAGEDSERVE_TENSOR_PARALLEL_SIZE)" in _refused(
        capsys, "worker", "--tensor-parallel-size", "2")


def test_one_key_may_not_take_every_webhook_thread(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--webhook-concurrency-per-key (PAGEDSERVE_WEBHOOK_CONCURRENCY_PER_KEY)" in _refused(
        capsys, "worker", "--webhook-concurrency", "4", "--webhook-concurrency-per-key", "4")
    assert _settings("worker", "--webhook-concurrency", "4", "--webhook-concurrency-per-key", "3"
                     ).webhook_concurrency_per_key == 3


def test_pipeline_parallel_size_is_one_stage_per_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert _settings("up", "--pipeline-parallel-size", "1").pipeline_parallel_size == 1
    assert "--pipeline-parallel-size (PAGEDSERVE_PIPELINE_PARALLEL_SIZE)" in _refused(
        capsys, "worker", "--pipeline-parallel-size", "2")


# as deployment and benchmark scripts start `vllm serve`
VLLM_COMMAND_LINE = ["--disable-log-requests", "--uvicorn-log-level", "warning", "--trust-remote-code",
                     "--no-enable-chunked-prefill", "--generation-config", "auto", "--max-logprobs", "20",
                     "--download-dir", "/tmp/models", "--max-num-seqs", "8", "--pipeline-parallel-size", "1"]


def test_a_vllm_serve_command_line_starts_and_the_flags_without_effect_are_named_in_one_warning(
    caplog: pytest.LogCaptureFixture
) -> None:
    args = cli._parser().parse_args(["up", "my-model", *VLLM_COMMAND_LINE])
    settings = cli.settings_from(args)
    assert settings.model == "my-model" and settings.max_num_seqs == 8
    with caplog.at_level("WARNING", logger="pagedserve.cli"):
        warn_without_effect(args)
    (record,) = caplog.records
    flags = record.getMessage().split()[1].removeprefix("flags=").split(",")
    assert sorted(flags) == sorted(["--disable-log-requests", "--uvicorn-log-level", "--trust-remote-code",
                                    "--generation-config", "--enable-chunked-prefill", "--max-logprobs",
                                    "--download-dir"])
    assert "nothing is downloaded" in record.getMessage()


@pytest.mark.parametrize("command", ["up", "api", "worker", "prepare"])
def test_every_flag_without_effect_is_taken_by_every_server_command(command: str) -> None:
    argv = [command]
    for flag, (takes_value, _) in FLAGS_WITHOUT_EFFECT.items():
        argv += [flag, "x"] if takes_value else [flag]
    assert given_without_effect(cli._parser().parse_args(argv)) == list(FLAGS_WITHOUT_EFFECT)


def test_api_keys_come_from_the_flag_or_one_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _settings("api", "--api-key", "k1", "k2").api_key == ["k1", "k2"]
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "one token, with a comma")  # as vLLM's VLLM_API_KEY: one token
    assert Settings().api_key == ["one token, with a comma"]
    child = cli.settings_env(_settings("up", "--api-key", "k1", "[k2"))
    monkeypatch.setenv("PAGEDSERVE_API_KEY", child["PAGEDSERVE_API_KEY"])
    assert Settings().api_key == ["k1", "[k2"]
    assert "--api-key (PAGEDSERVE_API_KEY)" in _refused(capsys, "api", "--api-key", " padded")
    assert "--api-key" not in _help(capsys, "worker")


@pytest.mark.parametrize("argv", [["keys", "list"], ["keys", "create", "--name", "x"], ["api"], ["worker"]])
def test_a_store_not_migrated_stops_what_reads_it_saying_to_migrate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, argv: list[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    model = ["--model", str(tiny_model_dir)] if argv[0] in ("api", "worker") else []
    message = _refused(capsys, *argv, *model, "--database-url", url, "--data-dir", str(tmp_path))
    assert "the job store is at revision none" in message and "run `pagedserve migrate` first" in message


def test_a_store_that_cannot_be_reached_is_said_so_by_the_key_commands(capsys: pytest.CaptureFixture[str]) -> None:
    message = _refused(capsys, "keys", "list", "--database-url", "postgresql+psycopg://127.0.0.1:1/nowhere")
    assert message.startswith("pagedserve keys: the job store cannot be reached")
