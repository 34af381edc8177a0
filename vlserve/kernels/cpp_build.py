"""Building the small C++ CPU kernels under csrc/ (one `extern "C" void kernel(...)` per file) with inductor's
C++ toolchain, once per process and cached on disk by inductor."""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"


def kernel_source(name: str) -> str:
    """csrc/`name` with its quoted includes (other csrc files) pasted in: inductor compiles one string."""
    return re.sub(r'^#include "([^"]+)"$', lambda m: kernel_source(m.group(1)), (CSRC / name).read_text(), flags=re.M)


@functools.cache
def load_cpu_kernel(source: str, declaration: str, arg_types: tuple[str, ...]):
    """csrc/`source` compiled for this CPU's vector ISA, as a Python callable of `arg_types`; None (and one
    warning) where it cannot be built here (no compiler, no vector ISA), so callers take their torch path."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        code = kernel_source(source)
        return CppPythonBindingsCodeCache.load_pybinding(
            list(arg_types), declaration, kernel_code=code, kernel_needs_vec_isa=True
        )
    except Exception as exc:
        first = str(exc).strip().splitlines()[:1]
        logger.warning("the C++ kernel %s could not be built (%s: %s); using torch", source, type(exc).__name__, first)
        return None
