"""Private copies of vlserve's Triton modules built for Triton's CPU interpreter, without touching the run.

Triton decides between a compiled `JITFunction` and an `InterpretedFunction` when `@triton.jit` runs,
i.e. when a module defining kernels is imported (triton 3.x: `knobs.runtime.interpret`, which reads the
TRITON_INTERPRET variable at that moment). `interpreted_triton_modules()` imports
vlserve.kernels.triton_* once more inside a window where the variable is 1, keeps the module objects,
and puts `sys.modules`, the `vlserve.kernels` package attributes and `os.environ` back as they were.

Triton's own library (`tl.zeros`, `tl.max`, ... in triton.language.standard) was decorated when
triton was first imported, normally in compiled mode, and a compiled `JITFunction` refuses to be
called from an interpreted kernel. So each launch of a copied kernel runs with `JITFunction.__call__`
patched to interpret the function instead, and restored when the launch returns: the interpreter then
behaves exactly as under a run-wide TRITON_INTERPRET=1, while triton stays compiled-mode for everyone
else (a CUDA run, the AOT compile check).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from types import ModuleType, SimpleNamespace
from unittest import mock

INTERPRET_ENV = "TRITON_INTERPRET"
# import order matters: a module must come after those it imports (triton_attention imports triton_kv_write,
# triton_paged and triton_prefill), so that it binds their interpreted copies
TRITON_MODULES = {
    "kv_write": "vlserve.kernels.triton_kv_write",
    "rotary": "vlserve.kernels.triton_rotary",
    "paged": "vlserve.kernels.triton_paged",
    "prefill": "vlserve.kernels.triton_prefill",
    "attention": "vlserve.kernels.triton_attention",
    "varlen": "vlserve.kernels.triton_varlen_attention",
}
# what the user's environment held when the test run started (None: unset)
USER_INTERPRET_VALUE = os.environ.get(INTERPRET_ENV)


def _import_fresh(names: list[str]) -> dict[str, ModuleType]:
    """Import `names` as new module objects, then restore sys.modules and the parent package's attributes."""
    package = importlib.import_module("vlserve.kernels")
    saved_modules = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    attrs = [name.rsplit(".", 1)[1] for name in names]
    saved_attrs = {attr: package.__dict__[attr] for attr in attrs if attr in package.__dict__}
    try:
        return {name: importlib.import_module(name) for name in names}
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved_modules)
        for attr in attrs:
            package.__dict__.pop(attr, None)
        package.__dict__.update(saved_attrs)


@functools.cache
def _interpreted_twin(fn):
    # fn: the Python function behind a compiled-mode JITFunction of triton's library
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def _call_interpreted(jit_function, *args, **kwargs):
    """Stands in for `JITFunction.__call__` during an interpreted launch: run the function interpreted."""
    return _interpreted_twin(jit_function.fn)(*args, **kwargs)


def _launch_with_interpreted_library(run):
    from triton.runtime.jit import JITFunction

    @functools.wraps(run)
    def launch(*args, **kwargs):
        with mock.patch.object(JITFunction, "__call__", _call_interpreted):
            return run(*args, **kwargs)

    return launch


def _wrap_kernels(module: ModuleType) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    for value in vars(module).values():
        if isinstance(value, InterpretedFunction) and "run" not in vars(value):
            value.run = _launch_with_interpreted_library(value.run)


@functools.cache
def interpreted_triton_modules() -> SimpleNamespace:
    """Namespace (kv_write, rotary, paged, prefill, attention, varlen) of vlserve Triton modules whose kernels run
    in the interpreter."""
    import triton  # noqa: F401  (imported outside the window: its library keeps its run-wide mode)
    import triton.language  # noqa: F401

    with mock.patch.dict(os.environ, {INTERPRET_ENV: "1"}):
        fresh = _import_fresh(list(TRITON_MODULES.values()))
    for module in fresh.values():
        _wrap_kernels(module)
    return SimpleNamespace(**{short: fresh[name] for short, name in TRITON_MODULES.items()})


@functools.cache
def interpreted_module(name: str) -> ModuleType:
    """A private copy of the one Triton module `name` (e.g. vlserve.kernels.triton_lora) whose kernels run in the
    interpreter (the kernel modules with tests of their own: fused MoE, WNA16, LoRA)."""
    import triton  # noqa: F401  (imported outside the window: its library keeps its run-wide mode)
    import triton.language  # noqa: F401

    with mock.patch.dict(os.environ, {INTERPRET_ENV: "1"}):
        module = _import_fresh([name])[name]
    _wrap_kernels(module)
    return module


def run_aot_script(script: str) -> str:
    """Run an ahead-of-time compile script (`triton.compile` to an sm_90 cubin; needs no GPU) in a fresh Python
    outside the interpreter, from the repository root; its stdout (AssertionError with its output on failure)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != INTERPRET_ENV}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def native_triton_modules() -> SimpleNamespace:
    """Namespace (kv_write, rotary, paged, prefill, attention, varlen) of the ordinary, process-wide vlserve Triton
    modules."""
    return SimpleNamespace(**{short: importlib.import_module(name) for short, name in TRITON_MODULES.items()})
