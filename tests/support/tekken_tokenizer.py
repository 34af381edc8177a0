"""A real full-size tokenizer without a model hub: Mistral's Tekken (131,072 tokens, byte-level BPE; the tokenizer of
Mistral NeMo and Pixtral), from the `tekken_240911.json` that the `mistral_common` wheel ships, converted by
transformers' own `convert_tekken_tokenizer` and saved as a Hugging Face tokenizer directory.

    python -m tests.support.tekken_tokenizer            # prints the directory (built once, then reused)

The wheel comes from the package registry (`pip download`); the conversion runs in a child process with
mistral_common and its few pure-Python needs on PYTHONPATH from a private folder, so this venv's packages (numpy
included, which mistral_common pins lower) stay as they are. Structured-output benchmarks and tests use it for a
real vocabulary's bitmask and grammar costs (the test tokenizer has 689 tokens).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MISTRAL_COMMON = "mistral_common==1.13.1"
CONVERTER_NEEDS = ("tiktoken", "pydantic-extra-types", "pycountry")  # imported by mistral_common's tokenizer code
TEKKEN_FILE = "mistral_common/data/tekken_240911.json"
VOCAB_SIZE = 131072

_CONVERT = r"""
import sys
from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer
tok = convert_tekken_tokenizer(sys.argv[1])
tok.save_pretrained(sys.argv[2])
"""


def default_dir() -> Path:
    """Where the tokenizer is kept: $VLSERVE_CACHE (default ~/.cache/vlserve) / tekken-131k."""
    root = os.environ.get("VLSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vlserve")
    return Path(root) / "tekken-131k"


def tekken_tokenizer_dir(out: str | os.PathLike | None = None, timeout: float = 300.0) -> str:
    """The Tekken tokenizer's directory, built on the first call (needs the package registry); raises
    RuntimeError naming the step that failed."""
    out = Path(out) if out is not None else default_dir()
    if (out / "tokenizer.json").is_file():
        return str(out)
    with tempfile.TemporaryDirectory(prefix="vlserve-tekken-") as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
        _run(
            [*pip, "download", "--no-deps", "-d", str(wheels), MISTRAL_COMMON], "downloading " + MISTRAL_COMMON, timeout
        )
        wheel = next(wheels.glob("mistral_common-*.whl"))
        _run(
            [*pip, "install", "--no-deps", "--target", str(site), str(wheel), *CONVERTER_NEEDS],
            "installing mistral_common for the conversion",
            timeout,
        )
        with zipfile.ZipFile(wheel) as zf:
            vocab = Path(zf.extract(TEKKEN_FILE, tmp))
        staging = Path(tmp) / "tokenizer"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
        _run([sys.executable, "-c", _CONVERT, str(vocab), str(staging)], "converting tekken.json", timeout, env)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp_out, ignore_errors=True)
        shutil.copytree(staging, tmp_out)  # then one rename: a reader never sees half a directory
        os.replace(tmp_out, out)
    return str(out)


def _run(cmd: list[str], what: str, timeout: float, env: dict | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"Tekken tokenizer: {what} failed: {(proc.stderr or proc.stdout).strip()[-800:]}")


if __name__ == "__main__":
    print(tekken_tokenizer_dir())
