"""The CPU's compiled kernels (``paged_kernels/csrc/``), built once per machine by torch's C++ extension tooling.

No maintained library ships a paged decode attention, fused norms, rotary embedding and SiLU, a few-row int8-, bf16-
or fp16-weight linear that reads at memory speed, a loop over a decode step's layers or a one-pass sampler, for
torch's CPU build (vLLM's and IPEX's are tied to their own builds and torch versions; torch's own ``rms_norm`` is
composed of the same five ops on the CPU), so these are ours: a few hundred lines of C++ that torch compiles with the
machine's compiler into its extension cache (``TORCH_EXTENSIONS_DIR``) on first use, and that later processes
load from that cache. ``None`` where it cannot be built; callers then stay on plain torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from paged_kernels.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

# one translation unit, in this order: simd_math_cpu.cpp's exponential and conversions serve the files after it,
# int8_linear_cpu.cpp's packing and argument checks int8_vnni_linear_cpu.cpp,
# and decode_stack_cpu.cpp calls the kernels of every file before it
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("simd_math_cpu.cpp", "paged_decode_cpu.cpp", "kv_cache_cpu.cpp", "layer_ops_cpu.cpp",
                        "int8_linear_cpu.cpp", "int8_vnni_linear_cpu.cpp", "bf16_linear_cpu.cpp",
                        "fp16_linear_cpu.cpp", "decode_stack_cpu.cpp", "sampler_cpu.cpp")]
FUNCTIONS = ["paged_decode", "write_kv_cache_", "rotary_", "add_rms_norm_", "silu_and_mul", "int8_pack_weight",
             "int8_linear", "has_int8_vnni_linear", "int8_vnni_pack_weight", "int8_vnni_linear",
             "has_bf16_linear", "has_amx_bf16_linear", "bf16_pack_weight", "bf16_linear", "has_fp16_linear",
             "fp16_pack_weight", "fp16_linear", "decode_layers", "sample_tokens"]


def extension_name() -> str:
    """The build's name: it carries the CPU's flags, since ``-march=native`` code runs only where they all are
    (a cache directory shared by two machines never hands one's build to the other)."""
    digest = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"pagedserve_cpu_kernels_{digest}"


def build_directory(name: str) -> Path:
    """Where the extension ``name`` is built and cached: under ``TORCH_EXTENSIONS_DIR`` (else torch's default root),
    one folder per Python and torch version, since a build links against both (torch's default names only the
    Python, and its cache would load a build made for another torch)."""
    from torch import __version__ as torch_version
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    directory = Path(root) / f"{python}_torch{torch_version}" / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def build_kernels(name: str, sources: list[str], march: str = "native", sanitizer: str | None = None,
                  functions: list[str] | None = None) -> ModuleType:
    """Compile ``sources`` (the texts of ``SOURCES``, in order) as the extension ``name`` for ``-march=march``
    (with ``-fsanitize=sanitizer`` for the tests' checked builds), or load that build from the extension cache;
    raises what the build raised. ``functions``: those the module exposes (``FUNCTIONS`` unless given: an older
    revision's sources define fewer)."""
    from torch.utils.cpp_extension import load_inline  # setuptools and friends: only when asked for

    sanitize = [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer"] if sanitizer else []
    directory = build_directory(name)
    # torch's own lock is a file that a process killed while building (a worker stopped during its first start)
    # leaves behind, and every later process then waits on it forever. An flock dies with its process: whoever
    # holds it is the only process in torch's build, so a lock file found then is such a leftover
    with open(directory / "build.flock", "w") as build_lock:
        fcntl.flock(build_lock, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        return load_inline(
            name=name, build_directory=str(directory), cpp_sources=sources,
            functions=FUNCTIONS if functions is None else functions,
            # torch's OpenMP runtime runs at::parallel_for here too (libgomp.so.1 is already loaded by torch).
            # -fno-trapping-math: no kernel reads floating-point exception flags, and with them kept GCC leaves the
            # selects of exp_nonpositive and SiLU as branches, so no loop that calls them was vectorized (the decode
            # softmax, the SiLU and the sampler's weights ran one float at a time: decode 1.1-1.35x, SiLU 4-5x
            # slower on a Zen 3). The softmax's total is now summed a vector at a time, in another order
            extra_cflags=["-O3", f"-march={march}", "-fopenmp", "-fno-trapping-math", *sanitize],
            extra_ldflags=["-fopenmp", *sanitize],
        )


@lru_cache(maxsize=1)
def cpu_kernels() -> ModuleType | None:
    """The compiled module (built on the first call in a machine's life, loaded after), or ``None`` with a
    warning when the build fails (no C++ compiler, no ninja)."""
    try:
        return build_kernels(extension_name(), [source.read_text() for source in SOURCES])
    except Exception as error:  # any build failure leaves the plain-torch path, which is always there
        logger.warning("CPU kernels unavailable, decode attention stays on torch's SDPA: %s", error)
        return None
