"""llama.cpp's ``llama-server`` as a baseline: built once from llama-cpp-python's sdist, on a BF16 GGUF.

The server runs continuous batching over one unified KV pool of ``--ctx-size kv_cache_tokens``
token cells (``--kv-unified``): the same budget pagedserve gets, shared by all slots as they grow.
Without ``--kv-unified`` llama-server would split the pool into fixed per-slot windows of
``kv_cache_tokens / slots`` tokens and cut requests short. llama-server does not preempt: if the
running requests outgrow the pool it fails them (HTTP 500, "context size has been exceeded"), so
it gets as many slots as fit the workload's longest request each (``safe_parallel_slots``), at
most ``max_num_seqs``: the reservation a user must make to run it safely under that budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
from tqdm.auto import tqdm

from benchmarks.workloads import Request
from engine.model_files import cache_dir as pagedserve_cache_dir

# pinned, so that every machine builds the llama.cpp these results were measured with (commit 0c1e57098bba)
SDIST_VERSION = "0.3.36"
SDIST_PACKAGE = f"llama-cpp-python=={SDIST_VERSION}"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
VENDOR_PREFIX = "vendor/llama.cpp/"
COMMIT_FILE = ".git/modules/vendor/llama.cpp/HEAD"  # the submodule's checked-out commit, inside the sdist
BUILD_JOBS = 2
BUILD_PROGRESS = re.compile(r"\[\s*\d+(%|/\d+)\]")  # make's "[ 42%]" or ninja's "[42/180]"; the rest goes to the log
CONVERT_SUMMARY = re.compile(r"WARNING|ERROR|INFO:hf-to-gguf:(Loading model|Model successfully)")
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
    # no HTTPS and no web UI (it would be fetched from Hugging Face): the benchmark only needs the API
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
]
HEALTH_TIMEOUT_S = 120.0
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # convert_hf_to_gguf.py's --outtype values the benchmarks use
WARMUP_PROMPT = list(range(1000, 1040))


def default_cache_dir() -> Path:
    """``llama.cpp`` under pagedserve's cache directory (``PAGEDSERVE_CACHE_DIR``, default ``~/.cache/pagedserve``)."""
    return pagedserve_cache_dir() / "llama.cpp"


def _run_niced(command: list[str], label: str, log_path: Path, echo: re.Pattern[str] | None = None) -> None:
    """Run ``command`` at the lowest CPU priority, logging its output and echoing the lines ``echo`` matches
    (all lines if None); raise with the log's tail if it fails."""
    print(f"{label}: {' '.join(command)}", flush=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(["nice", "-n", "19", *command], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if echo is None or echo.match(line):
                print(f"  {line}", end="", flush=True)
        returncode = process.wait()
    if returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise RuntimeError(f"{label} failed (exit {returncode}); log {log_path}; last lines:\n{tail}")


def _check_toolchain() -> None:
    """Fail early, before any download, when cmake or a C++ compiler is missing."""
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake not found on PATH: it is needed to build llama-server")
    compilers = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    if not any(shutil.which(compiler) for compiler in compilers if compiler):
        raise RuntimeError("no C++ compiler found (CXX, c++, g++ or clang++): it is needed to build llama-server")


def _download_sdist(folder: Path) -> Path:
    """llama-cpp-python's source archive in ``folder``, fetched with pip unless one is already there."""
    folder.mkdir(parents=True, exist_ok=True)
    sdist = folder / SDIST_FILE
    if not sdist.exists():
        _run_niced([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST_PACKAGE,
                    "-d", str(folder)], "pip download", folder / "pip-download.log")
    if not sdist.exists():
        raise RuntimeError(f"pip download left no {SDIST_FILE} in {folder}")
    return sdist


def _extract_vendor(sdist: Path, target: Path) -> str:
    """Extract ``vendor/llama.cpp`` of ``sdist`` into ``target``; return the llama.cpp commit or ``unknown``."""
    commit = "unknown"
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            _, _, inner = member.name.partition("/")
            if inner == COMMIT_FILE:
                commit = archive.extractfile(member).read().decode().strip()
            elif inner.startswith(VENDOR_PREFIX) and inner != VENDOR_PREFIX + ".git":  # .git points outside it
                member.name = inner.removeprefix(VENDOR_PREFIX)
                members.append(member)
        if not members:
            raise RuntimeError(f"{sdist} has no {VENDOR_PREFIX} folder")
        archive.extractall(target, members=members, filter="data")
    return commit


def ensure_source(cache_dir: Path | None = None) -> Path:
    """llama.cpp's source tree (``<cache_dir>/src``), from llama-cpp-python's sdist, extracted once."""
    cache_dir = cache_dir or default_cache_dir()
    source = cache_dir / "src"
    if not (source / "CMakeLists.txt").is_file():
        sdist = _download_sdist(cache_dir / "sdist")
        partial = Path(tempfile.mkdtemp(prefix="src-", dir=cache_dir))
        try:
            commit = _extract_vendor(sdist, partial)
        except BaseException:
            shutil.rmtree(partial)
            raise
        (partial / "pagedserve-source.json").write_text(json.dumps({"sdist": sdist.name, "commit": commit}) + "\n")
        shutil.rmtree(source, ignore_errors=True)
        partial.rename(source)  # whole or absent: an interrupted extraction is redone
    return source


def source_version(cache_dir: Path | None = None) -> dict[str, str]:
    """The sdist file name and llama.cpp commit the source tree came from."""
    return json.loads(((cache_dir or default_cache_dir()) / "src" / "pagedserve-source.json").read_text())


def ensure_server(cache_dir: Path | None = None) -> Path:
    """The ``llama-server`` binary, configured and built once under ``<cache_dir>/build`` (niced, 2 jobs)."""
    cache_dir = cache_dir or default_cache_dir()
    binary = cache_dir / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    _check_toolchain()
    source = ensure_source(cache_dir)
    build = cache_dir / "build"
    commit = source_version(cache_dir)["commit"]
    _run_niced(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS, f"-DLLAMA_BUILD_COMMIT={commit[:12]}"],
               "cmake configure", cache_dir / "configure.log")
    _run_niced(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(BUILD_JOBS)],
               "cmake build llama-server", cache_dir / "build.log", echo=BUILD_PROGRESS)
    if not binary.is_file():
        raise RuntimeError(f"the build finished but {binary} is missing; see {cache_dir / 'build.log'}")
    return binary


def ensure_gguf(model_folder: Path, cache_dir: Path | None = None, outtype: str = "bf16") -> Path:
    """A GGUF (``outtype``: f32, f16, bf16 or q8_0) of the Hugging Face ``model_folder``, converted once by llama.cpp's
    ``convert_hf_to_gguf.py``."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"outtype must be one of {', '.join(GGUF_TYPES)}, got {outtype!r}")
    cache_dir = cache_dir or default_cache_dir()
    folder = model_folder.resolve()
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    gguf = cache_dir / "models" / f"{folder.name}-{digest}-{outtype}.gguf"
    if gguf.is_file():
        return gguf
    script = ensure_source(cache_dir) / "convert_hf_to_gguf.py"
    gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_suffix(".part")
    _run_niced([sys.executable, str(script), str(folder), "--outtype", outtype, "--outfile", str(partial)],
               "convert_hf_to_gguf", gguf.with_suffix(".log"), echo=CONVERT_SUMMARY)
    partial.rename(gguf)
    return gguf


def completion_payload(request: Request) -> dict[str, Any]:
    """The ``/completion`` body for ``request``: its token ids, greedy, exactly ``output_len`` new tokens."""
    return {
        "prompt": request.prompt_token_ids, "n_predict": request.output_len, "ignore_eos": True,
        "temperature": 0.0, "cache_prompt": False, "stream": False,
    }


def server_command(server: Path, gguf: Path, port: int, kv_cache_tokens: int, parallel_slots: int,
                   threads: int) -> list[str]:
    """``llama-server`` arguments: ``parallel_slots`` slots sharing one unified KV pool of ``kv_cache_tokens``."""
    return [
        str(server), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--threads", str(threads), "--parallel", str(parallel_slots), "--cont-batching",
        "--ctx-size", str(kv_cache_tokens), "--kv-unified",
        "--cache-ram", "0",  # no host-RAM prompt cache: prompts are never reused here
    ]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _log_tail(log: IO[str], num_lines: int = 15) -> str:
    """The last lines the server wrote."""
    log.flush()
    log.seek(0)
    return "\n".join(log.read().splitlines()[-num_lines:])


def _wait_healthy(process: subprocess.Popen[str], base_url: str) -> None:
    """Poll ``/health`` until the model is loaded; raise if the server exits or times out first."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode} at start")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    raise RuntimeError(f"llama-server not healthy after {HEALTH_TIMEOUT_S:.0f} s")


def stop_process(process: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """Terminate a server process, killing it if it does not exit within ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def _complete_all(base_url: str, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """POST every payload to ``/completion`` at once; return the responses in order, raising on any error."""
    limits = httpx.Limits(max_connections=len(payloads), max_keepalive_connections=len(payloads))
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        with tqdm(total=len(payloads), desc="llama.cpp", unit="req", leave=False) as bar:
            async def complete(payload: dict[str, Any]) -> dict[str, Any]:
                response = await client.post("/completion", json=payload)
                bar.update(1)
                if response.status_code != 200:
                    raise RuntimeError(f"llama-server answered {response.status_code}: {response.text[:300]}")
                return response.json()

            return await asyncio.gather(*(complete(payload) for payload in payloads))


def safe_parallel_slots(requests: list[Request], kv_cache_tokens: int, max_num_seqs: int) -> int:
    """Slots that cannot overflow a pool of ``kv_cache_tokens``: each may hold the longest request."""
    longest = max(request.total_len for request in requests)
    return max(1, min(max_num_seqs, kv_cache_tokens // longest))


@contextmanager
def serving(server: Path, gguf: Path, kv_cache_tokens: int, parallel_slots: int, threads: int) -> Iterator[str]:
    """A llama-server on a free port, healthy and warmed up: yield its base URL, stop it afterwards.

    A failure while it runs (or at its start) is raised as a RuntimeError carrying the server's last log lines.
    """
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(server_command(server, gguf, port, kv_cache_tokens, parallel_slots, threads),
                                   stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_healthy(process, base_url)
            asyncio.run(_complete_all(base_url, [completion_payload(Request(WARMUP_PROMPT, 4))]))
            yield base_url
        except (RuntimeError, httpx.HTTPError) as error:
            raise RuntimeError(f"{error}\nllama-server's last lines:\n{_log_tail(log)}") from error
        finally:
            stop_process(process)


def run_server(requests: list[Request], server: Path, gguf: Path, kv_cache_tokens: int, parallel_slots: int,
               threads: int) -> dict[str, Any]:
    """Start llama-server, warm it up, send every request at once, and time until the last one finishes."""
    with serving(server, gguf, kv_cache_tokens, parallel_slots, threads) as base_url:
        start = time.monotonic()
        responses = asyncio.run(_complete_all(base_url, [completion_payload(r) for r in requests]))
        elapsed = time.monotonic() - start
    output_tokens = sum(response["tokens_predicted"] for response in responses)
    # a request stops early only if its slot's context (the whole pool here) runs out
    cut_short = sum(response["tokens_predicted"] < request.output_len
                    for response, request in zip(responses, requests, strict=True))
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "requests_per_s": len(requests) / elapsed,
        "requests_cut_short": cut_short,
        "note": (f"llama-server, BF16 GGUF, --parallel {parallel_slots} --ctx-size {kv_cache_tokens} --kv-unified "
                 f"(one KV pool of the same token budget, shared by all slots), --threads {threads}"),
    }
