"""The llama.cpp baseline without building llama.cpp: its requests, a stand-in server, and its failures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import throughput
from benchmarks.baselines import llama_cpp
from benchmarks.workloads import Request

# answers /health and /completion as llama-server does, generating exactly n_predict tokens
FAKE_SERVER = f"""#!{sys.executable}
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.reply({{"content": "", "tokens_predicted": body["n_predict"]}})

    def reply(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""


def _executable(folder: Path, text: str) -> Path:
    path = folder / "llama-server"
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_completion_payload_asks_for_exactly_output_len_greedy_tokens_from_token_ids() -> None:
    payload = llama_cpp.completion_payload(Request([5, 6, 7], output_len=9))
    assert payload["prompt"] == [5, 6, 7]
    assert payload["n_predict"] == 9 and payload["ignore_eos"] is True
    assert payload["temperature"] == 0.0 and payload["cache_prompt"] is False


def test_server_gets_the_whole_kv_budget_as_one_pool_shared_by_its_slots() -> None:
    command = llama_cpp.server_command(Path("llama-server"), Path("m.gguf"), 8080, kv_cache_tokens=1024,
                                       parallel_slots=32, threads=2)
    assert command[command.index("--ctx-size") + 1] == "1024" and "--kv-unified" in command
    assert command[command.index("--parallel") + 1] == "32" and command[command.index("--threads") + 1] == "2"


def test_slots_are_capped_so_that_every_slot_can_hold_the_longest_request() -> None:
    requests = [Request([1] * 10, output_len=20), Request([1] * 50, output_len=150)]
    assert llama_cpp.safe_parallel_slots(requests, kv_cache_tokens=1000, max_num_seqs=32) == 5
    assert llama_cpp.safe_parallel_slots(requests, kv_cache_tokens=1000, max_num_seqs=3) == 3
    assert llama_cpp.safe_parallel_slots(requests, kv_cache_tokens=100, max_num_seqs=32) == 1


def test_run_server_counts_the_tokens_the_server_reports_for_every_request(tmp_path: Path) -> None:
    requests = [Request([1, 2, 3], 5), Request([4], 7), Request([5, 6], 1)]
    result = llama_cpp.run_server(requests, _executable(tmp_path, FAKE_SERVER), tmp_path / "m.gguf",
                                  kv_cache_tokens=64, parallel_slots=4, threads=1)
    assert result["output_tokens"] == 13 and result["requests_cut_short"] == 0
    assert result["output_tokens_per_s"] > 0 and result["requests_per_s"] > 0


def test_server_that_exits_at_start_fails_with_its_last_log_lines(tmp_path: Path) -> None:
    server = _executable(tmp_path, "#!/bin/sh\necho 'gguf_init_from_file: invalid magic'\nexit 1\n")
    with pytest.raises(RuntimeError, match="exited with 1 at start(.|\n)*invalid magic"):
        llama_cpp.run_server([Request([1], 1)], server, tmp_path / "m.gguf", 64, 4, 1)


def test_missing_cmake_is_an_error_result_before_any_download(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = throughput.run_llama_cpp(throughput.parse_args(["--quick"]), [Request([1], 1)])
    assert "cmake not found" in result["error"]
    assert not (tmp_path / "llama.cpp" / "sdist").exists()
