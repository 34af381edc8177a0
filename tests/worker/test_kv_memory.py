"""Start-up memory of a CPU engine: the KV pool is reserved, not written, so its pages become resident only
as blocks are used; and the engine process loads no HF processor (its requests arrive processed), so transformers'
image-processing stack (torchvision, scipy) stays out of it. Residency is read per page from /proc/self/pagemap,
not from RSS, which every other allocation moves."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vlserve.worker.kv_memory import zeroed_kv_tensor

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident pages, pages) of a tensor's memory in this process: the present bit of each page's pagemap entry."""
    page = mmap.PAGESIZE
    start = t.data_ptr() // page
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = memoryview(f.read((end - start) * 8)).cast("Q")
    return sum(e >> 63 for e in entries), len(entries)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_kv_tensor_is_zero_and_resident_only_where_written(dtype):
    t = zeroed_kv_tensor((512, 16, 2, 48), dtype, torch.device("cpu"))
    assert t.shape == (512, 16, 2, 48) and t.dtype == dtype and t.is_contiguous()
    resident, pages = resident_pages(t)
    assert resident == 0 and pages >= 512 * 16 * 2 * 48 * t.element_size() // mmap.PAGESIZE
    t[7] = 1  # one block: a few pages
    block_pages = -(-16 * 2 * 48 * t.element_size() // mmap.PAGESIZE) + 1
    assert 0 < resident_pages(t)[0] <= block_pages
    as_float = t.float()
    assert as_float[7].eq(1).all() and as_float[:7].eq(0).all() and as_float[8:].eq(0).all()


def test_non_cpu_kv_tensor_is_torch_zeros():
    t = zeroed_kv_tensor((4, 16, 2, 8), torch.bfloat16, torch.device("meta"))
    assert t.device.type == "meta" and t.shape == (4, 16, 2, 8) and t.dtype == torch.bfloat16


_ENGINE_PROBE = textwrap.dedent("""
    import json, sys
    from tests.worker.test_kv_memory import resident_pages
    from vlserve.config import EngineArgs
    from vlserve.demo import default_model_path
    from vlserve.engine.core import EngineCore

    core = EngineCore(EngineArgs(model=default_model_path(), max_model_len=512, max_num_seqs=4), processor=False)
    loaded = core.loaded
    print(json.dumps({
        "kv": [resident_pages(t) for pair in core.runner.kv_caches for t in pair],
        "mm_processor": loaded.mm_processor is None and loaded.processor is None,
        "modalities": list(loaded.modalities), "mrope": loaded.mrope_positions_fn is not None,
        "imported": [m for m in ("torchvision", "transformers.image_processing_utils", "scipy") if m in sys.modules],
    }))
""")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU KV pool (anonymous mmap): on CUDA the engine's KV lives in GPU memory"
)
def test_engine_process_core_starts_with_an_untouched_kv_pool_and_no_hf_processor():
    """What core_proc builds: EngineCore(args, processor=False) on the demo model, profile and warm-up included, in a
    fresh interpreter (this one has imported everything already)."""
    out = subprocess.run([sys.executable, "-c", _ENGINE_PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kv"] and all(resident == 0 and pages > 0 for resident, pages in got["kv"]), got["kv"]
    assert got["mm_processor"] and got["modalities"] == ["image", "video"] and got["mrope"]
    assert got["imported"] == [], f"the engine process imports the HF image-processing stack: {got['imported']}"
