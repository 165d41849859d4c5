"""Serving throughput and latency as users measure them: guidellm against `pagedserve up` and llama.cpp's server.

One command, one fixed workload (synthetic prompts of exact token counts, EOS ignored, ``/v1/completions``),
streaming and non-streaming, at each concurrency asked for. pagedserve runs as ``pagedserve up`` starts it
(its settings' defaults; ``--pagedserve-flags`` adds any of its flags) on a fresh data directory and its own
embedded Redis; llama-server runs on every GGUF type × slot count asked for, and its best configuration per
mode and concurrency is the one pagedserve is compared with. Each run's prompts are new to the server it meets (a
guidellm seed per round, mode and concurrency, the same for every system), so no prefix cache answers a run from an
earlier one; ``--repeat-prompts`` sends every run guidellm's default prompts, as the runs before the thirty-first
session did (llama.cpp's slots then reuse whole prompts they kept, our prefix cache all but the last partial
block). ``offline`` runs the same workload through the engine in this process (benchmarks/serve_offline.py): the
ceiling the service is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

from benchmarks import guidellm_client, serve_offline, serve_report
from benchmarks.baselines import llama_cpp
from benchmarks.common import RESULTS_DIR, machine, print_table, write_json
from benchmarks.guidellm_client import Target, Workload
from engine.model_files import resolve_model

MODES = {"non-streaming": False, "streaming": True}
SYSTEMS = ("pagedserve", "llama.cpp", serve_offline.SYSTEM)
# guidellm counts prompt tokens with the model folder's tokenizer; llama.cpp's (BOS, merges) may differ slightly
SLOT_SLACK_TOKENS = 64
STARTUP_TIMEOUT_S = 900.0  # the first start converts the model's weights
API_KEY_LINE = re.compile(r"development API key: (\S+)")
# The worker's engine-step counters, read before and after each run: how much of the client's window the engine
# spent stepping, and how full its steps were (a service that loses against the offline engine shows it here).
ENGINE_COUNTERS = {"engine_busy_s": "pagedserve_step_duration_seconds_sum",
                   "engine_steps": "pagedserve_step_duration_seconds_count",
                   "engine_rows": "pagedserve_batch_size_sum"}
SERVICE_ROLES = ("api", "worker", "redis")  # the processes of `pagedserve up` whose CPU each run records
T = TypeVar("T")


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options; every list option picks a subset of the matrix."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or HF folder")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--concurrency", nargs="+", type=positive_int, default=[8, 32], help="requests in flight")
    parser.add_argument("--requests", type=positive_int, default=96, help="requests per run")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128)
    parser.add_argument("--output-tokens", type=positive_int, default=128)
    parser.add_argument("--pagedserve-flags", default="",
                        help="extra `pagedserve up` flags, e.g. '--quantization int8'")
    parser.add_argument("--gguf-types", nargs="+", choices=llama_cpp.GGUF_TYPES, default=list(llama_cpp.GGUF_TYPES))
    parser.add_argument("--slots", nargs="+", type=positive_int, default=[8, 16, 32], help="llama-server --parallel")
    parser.add_argument("--llama-threads", type=positive_int, default=os.cpu_count() or 1,
                        help="llama-server --threads")
    parser.add_argument("--client-processes", type=positive_int, default=1, help="guidellm worker processes")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="rounds of the whole matrix, one after another; each system's fastest run of a cell "
                             "is compared (hosts drift in speed within minutes)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="serve", help="file names of the results: <name>.json, .md, .png")
    parser.add_argument("--repeat-prompts", action="store_true",
                        help="every run sends guidellm's default prompts (a server's caches then answer most of a "
                             "prompt it met in an earlier run) instead of prompts of its own")
    parser.add_argument("--keep-others", action="store_true",
                        help="keep the runs an earlier <name>.json recorded for the systems not measured now "
                             "(same workload), e.g. to re-measure pagedserve against llama.cpp's recorded runs")
    return parser.parse_args(argv)


def earlier_runs(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]], dict[str, Any] | None]:
    """The command, the rows of the other systems and the llama.cpp source they ran (if any) from <name>.json, for
    --keep-others."""
    path = args.out / f"{args.name}.json"
    if not path.is_file():
        raise SystemExit(f"--keep-others: there is no {path} to keep runs from")
    earlier = json.loads(path.read_text())
    # files written before the thirty-first session sent every run the same prompts and did not say so
    if {"repeat_prompts": True, **earlier["workload"]} != asdict(workload(args)):
        raise SystemExit(f"--keep-others: {path} measured another workload ({earlier['workload']}); "
                         "give the same --requests, --prompt-tokens, --output-tokens and --repeat-prompts")
    return (earlier["command"], [row for row in earlier["rows"] if row["system"] not in args.systems],
            earlier.get("llama_cpp"))


def _poll(ready: Callable[[], T | None], process: subprocess.Popen[bytes], what: str) -> T:
    """Call ``ready`` until it returns a value; fail if ``process`` exits or STARTUP_TIMEOUT_S passes first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pagedserve up exited with {process.returncode} while waiting for {what}")
        try:
            value = ready()
        except httpx.TransportError:
            value = None  # the API is not listening yet
        if value is not None:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {STARTUP_TIMEOUT_S:.0f} s waiting for {what}")


def engine_counters(metrics_url: str, row: dict[str, Any]) -> dict[str, float] | None:
    """The worker's ENGINE_COUNTERS now, from its Prometheus endpoint; None (and the reason in ``row``) when it does
    not answer: the run is measured all the same, without what the engine did."""
    wanted = {sample: name for name, sample in ENGINE_COUNTERS.items()}
    values = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    try:
        text = httpx.get(metrics_url, timeout=10.0).raise_for_status().text
    except httpx.HTTPError as error:
        row["engine_counters_error"] = f"{metrics_url}: {error!r}"
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[wanted[sample.name]] += sample.value
    return values


def engine_share(before: dict[str, float], after: dict[str, float], duration_s: float) -> dict[str, Any]:
    """What the engine did during a run of ``duration_s``: time stepping (and its share), steps, rows per step."""
    delta = {name: after[name] - before[name] for name in ENGINE_COUNTERS}
    steps = int(delta["engine_steps"])
    return {"engine_busy_s": delta["engine_busy_s"],
            "engine_busy_share": delta["engine_busy_s"] / duration_s if duration_s > 0 else 0.0,
            "engine_steps": steps, "engine_rows_per_step": delta["engine_rows"] / steps if steps else 0.0}


def service_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far (user + system) of the processes `pagedserve up` (``pid``) started, by role: its API, its
    worker (the engine's threads included) and its embedded Redis."""
    seconds = dict.fromkeys(SERVICE_ROLES, 0.0)
    for child in psutil.Process(pid).children(recursive=True):
        try:
            command, name, times = child.cmdline(), child.name(), child.cpu_times()
        except psutil.Error:  # it ended meanwhile
            continue
        role = "redis" if name == "redis-server" else command[-1] if command else ""
        if role in seconds:
            seconds[role] += times.user + times.system
    return seconds


def cpu_per_token(before: dict[str, float], after: dict[str, float], output_tokens: float) -> dict[str, float]:
    """Each service process's CPU milliseconds per output token over a run: what the API and Redis cost beside the
    engine, a cost that a host shared with the engine pays in engine time."""
    return {f"{role}_cpu_ms_per_token": 1000.0 * (after[role] - before[role]) / output_tokens
            for role in SERVICE_ROLES if output_tokens > 0}


def checkout_env(source: Path | None) -> dict[str, Any]:
    """Popen's arguments that make `python -m cli.main` run the checkout `source` (this one when None)."""
    if source is None:
        return {}
    return {"cwd": source, "env": {**os.environ, "PYTHONPATH": str(source)}}


@dataclass(frozen=True, slots=True)
class RunningService:
    """A started `pagedserve up`: where it answers, its worker's metrics URL, and its process id."""

    target: Target
    metrics_url: str
    pid: int


@contextmanager
def pagedserve_up(model: str, extra_flags: list[str], work_dir: Path,
                  source: Path | None = None) -> Iterator[RunningService]:
    """`pagedserve up` on a free port, a fresh data directory and its own embedded Redis, yielded once the worker
    has answered a warm-up request; stopped afterwards. `source`: another checkout to run (first on its PYTHONPATH)
    instead of this one."""
    port, metrics_port = llama_cpp.free_port(), llama_cpp.free_port()
    command = [sys.executable, "-m", "cli.main", "up", "--model", model, "--port", str(port),
               "--data-dir", str(work_dir / "data"), "--redis-url", f"redis://127.0.0.1:{llama_cpp.free_port()}/0",
               *extra_flags, "--metrics-port", str(metrics_port)]  # last: the counters are read from this port
    log_path = work_dir / "pagedserve-up.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **checkout_env(source))
    try:
        api_key = _poll(lambda: (match := API_KEY_LINE.search(log_path.read_text())) and match.group(1),
                        process, "its API key")
        target = Target(f"http://127.0.0.1:{port}", model, api_key)
        warm_up = {"model": model, "prompt": "Hello", "max_tokens": 4}
        _poll(lambda: httpx.post(f"{target.base_url}/v1/completions", json=warm_up, timeout=STARTUP_TIMEOUT_S,
                                 headers={"Authorization": f"Bearer {api_key}"}).raise_for_status(),
              process, "a warm-up completion")
        yield RunningService(target, f"http://127.0.0.1:{metrics_port}/metrics", process.pid)
    except (RuntimeError, httpx.HTTPError) as error:
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise RuntimeError(f"{error}\npagedserve up's last lines:\n{tail}") from error
    finally:
        llama_cpp.stop_process(process, timeout_s=90.0)  # `up` gives its children 60 s each


def prompt_seed(args: argparse.Namespace, round_number: int, mode: str, concurrency: int) -> int:
    """guidellm's seed for a run's prompts: its default with --repeat-prompts, else one of the round, mode and
    concurrency's own, the same for every system."""
    if args.repeat_prompts:
        return guidellm_client.DEFAULT_PROMPT_SEED
    return round_number * 1_000_000 + list(MODES).index(mode) * 100_000 + concurrency


def workload(args: argparse.Namespace) -> Workload:
    """The fixed workload the options describe."""
    return Workload(args.requests, args.prompt_tokens, args.output_tokens, args.repeat_prompts)


@dataclass(slots=True)
class Results:
    """The runs so far, written out after each one, so that an interrupted benchmark keeps what it measured."""

    args: argparse.Namespace
    command: str
    tokenizer_dir: Path
    work_dir: Path
    progress: tqdm
    rows: list[dict[str, Any]] = field(default_factory=list)
    round: int = 1  # of --rounds, recorded with each run
    kept_llama_cpp: dict[str, Any] | None = None  # the source of llama.cpp's kept runs (--keep-others)

    def add(self, row: dict[str, Any]) -> None:
        """Record a run (or a server that failed) and rewrite the result files."""
        self.rows.append({**row, "round": self.round})
        self.progress.update(1)
        self.write()

    def run_cells(self, target: Target, system: str, config: str, service: RunningService | None = None) -> None:
        """One guidellm run per mode and concurrency against ``target``; a failed run is a row with its error.
        With ``service`` (pagedserve), each row also gets what the engine did meanwhile and what CPU each of the
        service's processes took per output token."""
        for mode in self.args.modes:
            for concurrency in self.args.concurrency:
                row: dict[str, Any] = {"system": system, "config": config, "mode": mode, "concurrency": concurrency}
                self.progress.set_description(f"{system} {config} {mode} x{concurrency}")
                before = engine_counters(service.metrics_url, row) if service else None
                cpu_before = service_cpu_s(service.pid) if service else {}
                row["prompt_seed"] = prompt_seed(self.args, self.round, mode, concurrency)
                try:
                    row |= guidellm_client.run(target, self.tokenizer_dir, workload(self.args), MODES[mode],
                                               concurrency, self.args.client_processes, self.work_dir,
                                               row["prompt_seed"])
                except RuntimeError as error:
                    row["error"] = str(error)
                if service is not None and "error" not in row:
                    row |= cpu_per_token(cpu_before, service_cpu_s(service.pid), row["output_tokens"])
                    after = engine_counters(service.metrics_url, row) if before is not None else None
                    if before is not None and after is not None:
                        row |= engine_share(before, after, row["duration_s"])
                self.add(row)

    def write(self) -> dict[str, Any]:
        """Write <name>.json, .md and .png under --out; return the JSON payload."""
        payload = {
            "benchmark": "serve", "method": __doc__.strip(), "command": self.command,
            "workload": asdict(workload(self.args)),
            "client": {"guidellm": version("guidellm"), "processes": self.args.client_processes},
            "machine": machine(), "rows": self.rows, "comparisons": comparisons(self.rows),
        }
        if any(row["system"] == "llama.cpp" and "error" not in row for row in self.rows):
            # runs kept from an earlier file name the source they ran; this machine need not have built one
            measured = "llama.cpp" in self.args.systems
            payload["llama_cpp"] = llama_cpp.source_version() if measured else self.kept_llama_cpp
        write_json(self.args.name, payload, self.args.out)
        (self.args.out / f"{self.args.name}.md").write_text(serve_report.markdown(payload))
        serve_report.save_plot(payload, self.args.out / f"{self.args.name}.png")
        return payload


def measure_pagedserve(results: Results) -> None:
    """The matrix against `pagedserve up`; if it does not start, an error row."""
    args = results.args
    config = args.pagedserve_flags or "defaults"
    try:
        with pagedserve_up(args.model, shlex.split(args.pagedserve_flags), results.work_dir) as service:
            results.run_cells(service.target, "pagedserve", config, service)
    except RuntimeError as error:
        results.add({"system": "pagedserve", "config": config, "error": str(error)})


def measure_offline(results: Results) -> None:
    """The offline engine at each concurrency (no client, no modes); an engine that fails is an error row."""
    args = results.args
    for concurrency in args.concurrency:
        row: dict[str, Any] = {"system": serve_offline.SYSTEM, "config": f"engine, max_num_seqs={concurrency}",
                               "mode": "offline", "concurrency": concurrency}
        results.progress.set_description(f"offline engine x{concurrency}")
        try:
            row |= serve_offline.run(args.model, shlex.split(args.pagedserve_flags), workload(args), concurrency)
        except (RuntimeError, ValueError) as error:
            row["error"] = str(error)
        results.add(row)


def llama_cpp_kv_tokens(slots: int, workload: Workload) -> int:
    """The KV pool llama-server needs for ``slots`` requests of ``workload`` at once, each with some slack."""
    return slots * (workload.prompt_tokens + workload.output_tokens + SLOT_SLACK_TOKENS)


def llama_cpp_config(outtype: str, slots: int) -> str:
    """How a llama-server configuration is named in the results."""
    return f"{outtype.upper()} GGUF, {slots} slots"


def measure_llama_cpp(results: Results) -> None:
    """The matrix against llama-server for every GGUF type and slot count; a server that fails is an error row."""
    args = results.args
    try:
        server = llama_cpp.ensure_server()
    except RuntimeError as error:
        results.add({"system": "llama.cpp", "config": "build", "error": str(error)})
        return
    for outtype in args.gguf_types:
        for slots in args.slots:
            config = llama_cpp_config(outtype, slots)
            try:
                gguf = llama_cpp.ensure_gguf(results.tokenizer_dir, outtype=outtype)
                with llama_cpp.serving(server, gguf, llama_cpp_kv_tokens(slots, workload(args)), slots,
                                       args.llama_threads) as base_url:
                    results.run_cells(Target(base_url, args.model), "llama.cpp", config)
            except RuntimeError as error:
                results.add({"system": "llama.cpp", "config": config, "error": str(error)})


def best_per_cell(rows: list[dict[str, Any]], system: str) -> dict[tuple[str, int], dict[str, Any]]:
    """``system``'s fastest row per (mode, concurrency), among runs where every request succeeded."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        if row["system"] != system or "error" in row or row["requests_failed"]:
            continue
        cell = (row["mode"], row["concurrency"])
        if cell not in best or row["output_tokens_per_s"] > best[cell]["output_tokens_per_s"]:
            best[cell] = row
    return best


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and concurrency: pagedserve's output tok/s, llama.cpp's best configuration's, and their ratio;
    and pagedserve's share of the offline engine's tok/s at the same concurrency."""
    ours, theirs = best_per_cell(rows, "pagedserve"), best_per_cell(rows, "llama.cpp")
    offline = {concurrency: row for (_, concurrency), row in best_per_cell(rows, serve_offline.SYSTEM).items()}
    result = []
    for cell in sorted(ours.keys() | theirs.keys()):
        entry: dict[str, Any] = {"mode": cell[0], "concurrency": cell[1]}
        if cell in ours:
            entry["pagedserve_output_tokens_per_s"] = ours[cell]["output_tokens_per_s"]
        if cell in theirs:
            entry["llama_cpp_best_config"] = theirs[cell]["config"]
            entry["llama_cpp_best_output_tokens_per_s"] = theirs[cell]["output_tokens_per_s"]
        if cell in ours and cell in theirs:
            entry["pagedserve_over_llama_cpp"] = (ours[cell]["output_tokens_per_s"]
                                                  / theirs[cell]["output_tokens_per_s"])
        if cell in ours and cell[1] in offline:
            entry["offline_output_tokens_per_s"] = offline[cell[1]]["output_tokens_per_s"]
            entry["pagedserve_over_offline"] = (ours[cell]["output_tokens_per_s"]
                                                / offline[cell[1]]["output_tokens_per_s"])
        result.append(entry)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the matrix, print the tables, and write <name>.json, .md and .png under --out (after every run)."""
    args = parse_args(argv)
    command = "python -m benchmarks.serve " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows: list[dict[str, Any]] = []
    kept_llama_cpp = None
    if args.keep_others:
        earlier_command, rows, kept_llama_cpp = earlier_runs(args)
        command = f"{earlier_command}\n{command}"
    tokenizer_dir = resolve_model(args.model)  # guidellm's tokenizer and llama.cpp's source weights
    configs = {"pagedserve": len(args.modes), "llama.cpp": len(args.gguf_types) * len(args.slots) * len(args.modes),
               "offline": 1}
    total = sum(configs[system] for system in args.systems) * len(args.concurrency) * args.rounds
    with tempfile.TemporaryDirectory(prefix="serve-") as work, tqdm(total=total, unit="run") as progress:
        results = Results(args, command, tokenizer_dir, Path(work), progress, rows, kept_llama_cpp=kept_llama_cpp)
        for round_number in range(1, args.rounds + 1):
            results.round = round_number
            # the offline engine right after the service: hosts drift in speed within minutes, and service ÷
            # offline compares these two
            if "pagedserve" in args.systems:
                measure_pagedserve(results)
            if "offline" in args.systems:
                measure_offline(results)
            if "llama.cpp" in args.systems:
                measure_llama_cpp(results)
        payload = results.write()
    print_table("guidellm runs", payload["rows"], serve_report.ROW_COLUMNS)
    print_table("pagedserve vs llama.cpp's best", payload["comparisons"], serve_report.COMPARISON_COLUMNS)
    return payload


if __name__ == "__main__":
    main()
