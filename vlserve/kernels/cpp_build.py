"""Building the small C++ CPU kernels under csrc/ (one `extern "C" void kernel(...)` per entry source, other files
pasted in where it includes them) with inductor's C++ toolchain, once per process and cached on disk by inductor.

Every loader goes through `load_cpu_kernel`, which returns None where a source cannot be built (its callers then
take their torch path) and records the outcome per source (`build_outcomes`), so a test can tell a kernel that
should build but did not from one this machine never runs."""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
_OUTCOMES: dict[str, bool] = {}  # per entry source asked for in this process: whether every build of it succeeded


def kernel_source(name: str) -> str:
    """csrc/`name` with its quoted includes (other csrc files) pasted in: inductor compiles one string."""
    return re.sub(r'^#include "([^"]+)"$', lambda m: kernel_source(m.group(1)), (CSRC / name).read_text(), flags=re.M)


def entry_sources() -> list[str]:
    """The csrc files that define a kernel entry point (`extern "C"`), each built by a loader of its own."""
    return sorted(p.name for p in CSRC.glob("*.cpp") if 'extern "C"' in p.read_text())


def build_outcomes() -> dict[str, bool]:
    """Per entry source a loader has asked for in this process: whether each of its builds succeeded."""
    return dict(_OUTCOMES)


@functools.cache
def load_cpu_kernel(
    source: str, declaration: str, arg_types: tuple[str, ...], prefix: str = "", fallback: str = "torch"
):
    """csrc/`source`, after `prefix` (defines, a target pragma: another text, so another build), compiled for this
    CPU's vector ISA, as a Python callable of `arg_types`; None where it cannot be built here (no compiler, no vector
    ISA), with one warning naming `fallback`, what its callers run instead."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        kernel = CppPythonBindingsCodeCache.load_pybinding(
            list(arg_types), declaration, kernel_code=prefix + kernel_source(source), kernel_needs_vec_isa=True
        )
    except Exception as exc:
        first = str(exc).strip().splitlines()[:1]
        logger.warning(
            "the C++ kernel %s could not be built (%s: %s); using %s", source, type(exc).__name__, first, fallback
        )
        kernel = None
    _OUTCOMES[source] = _OUTCOMES.get(source, True) and kernel is not None
    return kernel
