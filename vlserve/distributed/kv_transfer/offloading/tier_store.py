"""The offloading connector's worker side: copies KV blocks between the runner's caches, a host buffer and files.

A block's data, as stored: `[L, 2, block_size, Hkv, D]` (every layer this rank holds, K then V) in the KV cache
dtype. A file is one JSON header line (format, dtype, shape, payload bytes, blake2b of the payload) and the raw
payload; it is written to a temporary name and renamed, so a reader never sees half a file unless the disk lies.
A file that fails any check (header, dtype, shape, size, checksum) is deleted and reported; the request then
recomputes. A write that fails (disk full) is reported and the block simply is not on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch

from vlserve.distributed.kv_transfer.base import KVConnectorOutput

logger = logging.getLogger(__name__)

FORMAT = "vlserve-kv-block-1"
FILE_SUFFIX = ".kvb"


class TierFileError(Exception):
    """A tier file that is missing or fails its checks."""


def _header_line(fmt: str, dtype: torch.dtype, shape: list[int], payload: bytes) -> bytes:
    header = {
        "format": fmt,
        "dtype": str(dtype),
        "shape": list(shape),
        "nbytes": len(payload),
        "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest(),
    }
    return json.dumps(header).encode() + b"\n"


def checked_file_bytes(fmt: str, dtype: torch.dtype, shape: list[int]) -> int:
    """The size on disk of the file `write_checked_file` writes for a tensor of this dtype and shape."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return len(_header_line(fmt, dtype, shape, b"")) + len(str(nbytes)) - 1 + nbytes  # (the digest's length is fixed)


def write_checked_file(path: str, fmt: str, tensor: torch.Tensor) -> None:
    """One JSON header line (format, dtype, shape, payload bytes, blake2b of the payload), then the raw payload of
    `tensor`; written to a temporary name and renamed. OSError when it cannot be written (nothing left behind)."""
    tensor = tensor.detach().contiguous().cpu()
    payload = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(_header_line(fmt, tensor.dtype, list(tensor.shape), payload))
            f.write(payload)
        os.replace(tmp, path)
    except OSError:
        with _quiet():
            os.remove(tmp)
        raise


def read_checked_file(path: str, fmt: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor `write_checked_file` wrote at `path`; TierFileError when the file is missing, or its format,
    dtype, shape (-1 in `shape`: any size), size or checksum is not what it should be."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline(4096))
            payload = f.read()
    except (OSError, ValueError) as e:
        raise TierFileError(f"{path}: {e}") from None
    got = header.get("shape") if isinstance(header, dict) else None
    if (
        not isinstance(header, dict)
        or header.get("format") != fmt
        or header.get("dtype") != str(dtype)
        or not isinstance(got, list)
        or len(got) != len(shape)
        or any(not isinstance(g, int) or g < 0 or (s != -1 and g != s) for g, s in zip(got, shape))
    ):
        raise TierFileError(f"{path}: header {header} does not match format {fmt}, dtype {dtype}, shape {shape}")
    if header.get("nbytes") != len(payload):
        raise TierFileError(f"{path}: {len(payload)} payload bytes, the header says {header.get('nbytes')}")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("blake2b"):
        raise TierFileError(f"{path}: checksum mismatch")
    numel = 1
    for g in got:
        numel *= g
    if numel * torch.empty((), dtype=dtype).element_size() != len(payload):
        raise TierFileError(f"{path}: {len(payload)} payload bytes for shape {got} of {dtype}")
    if not payload:
        return torch.empty(got, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(got)


class TierStore:
    def __init__(self, num_cpu_blocks: int, disk_dir: str | None):
        self.num_cpu_blocks = num_cpu_blocks
        self.disk_dir = disk_dir
        if disk_dir is not None:
            os.makedirs(disk_dir, exist_ok=True)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host: torch.Tensor | None = None
        self._out = KVConnectorOutput()
        self._warned_write = False

    def register_kv_caches(self, kv_caches, draft_kv_cache=None) -> None:
        """The target's layers, and the EAGLE draft's pair as one more layer when its pages have the same shape
        and dtype (else the draft's prompt KV is not kept: a tier hit then gets fewer drafts accepted)."""
        self.layers = [pair for pair in kv_caches if pair is not None]
        k = self.layers[0][0]
        if draft_kv_cache is not None:
            d = draft_kv_cache[0]
            if d.shape[1:] == k.shape[1:] and d.dtype == k.dtype:
                self.layers.append(draft_kv_cache)
            else:
                logger.warning(
                    "KV offloading: the EAGLE draft's KV pages %s differ from the target's %s: the tier "
                    "keeps the target's only",
                    tuple(d.shape[1:]),
                    tuple(k.shape[1:]),
                )
        self.block_shape = (len(self.layers), 2, *k.shape[1:])
        self.dtype = k.dtype
        self.device = k.device
        if self.num_cpu_blocks:
            self.host = torch.empty(
                (self.num_cpu_blocks, *self.block_shape), dtype=self.dtype, pin_memory=k.device.type == "cuda"
            )

    # -- copies ------------------------------------------------------------------------------------------------
    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """`[n, L, 2, BS, H, D]` of these device blocks."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack(
            [torch.stack((k.index_select(0, idx), v.index_select(0, idx)), dim=1) for k, v in self.layers], dim=1
        )

    def _scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device, non_blocking=False)
        for layer, (k, v) in enumerate(self.layers):
            k.index_copy_(0, idx, data[:, layer, 0])
            v.index_copy_(0, idx, data[:, layer, 1])

    # -- files -------------------------------------------------------------------------------------------------
    def _path(self, key: bytes) -> str:
        return os.path.join(self.disk_dir, key.hex() + FILE_SUFFIX)

    def _write_file(self, key: bytes, block: torch.Tensor) -> None:
        path = self._path(key)
        try:
            write_checked_file(path, FORMAT, block)
        except OSError as e:
            if not self._warned_write:
                logger.warning(
                    "KV offloading: could not write %s (%s); blocks that do not fit stay off the disk tier", path, e
                )
                self._warned_write = True
            self._out.extra.setdefault("failed_store_keys", []).append(key)

    def evict(self, keys: list[bytes]) -> None:
        """Delete these blocks' files (the disk tier's least recently used, over its size cap)."""
        for key in keys:
            with _quiet():
                os.remove(self._path(key))

    def _read_file(self, key: bytes) -> torch.Tensor:
        return read_checked_file(self._path(key), FORMAT, self.dtype, list(self.block_shape))

    # -- the step ----------------------------------------------------------------------------------------------
    def load(self, loads: dict[str, list[tuple[int, int, bytes]]]) -> None:
        """Before the forward: each request's blocks from the host slots or files, all or nothing per request."""
        out = self._out
        for rid, items in loads.items():
            out.finished_recving.add(rid)
            try:
                blocks = [b for b, _, _ in items]
                data = [self.host[slot] if slot >= 0 else self._read_file(key) for _, slot, key in items]
                self._scatter(blocks, torch.stack(data))
            except TierFileError as e:
                logger.warning("KV offloading: request %s recomputes its prefix: %s", rid, e)
                out.failed_recving.add(rid)
                bad = [key for _, slot, key in items if slot < 0 and not self._file_ok(key)]
                out.extra.setdefault("bad_keys", []).extend(bad)

    def _file_ok(self, key: bytes) -> bool:
        try:
            self._read_file(key)
            return True
        except TierFileError:
            with _quiet():
                os.remove(self._path(key))
            return False

    def store(self, stores: list[tuple[int, int, bytes, bool]]) -> None:
        """After the forward: the blocks it completed, to their host slots and / or files."""
        data = self._gather([b for b, _, _, _ in stores])  # [n, L, 2, BS, H, D]
        last: dict[int, int] = {}  # host slot -> the last store into it (an LRU slot reused in the same step)
        for i, (_, slot, key, to_disk) in enumerate(stores):
            if slot >= 0:
                last[slot] = i
            if to_disk:
                self._write_file(key, data[i])
        if last:
            slots = torch.tensor(list(last), dtype=torch.long)
            rows = torch.tensor(list(last.values()), dtype=torch.long, device=data.device)
            self.host.index_copy_(0, slots, data.index_select(0, rows).cpu())

    def take_output(self) -> KVConnectorOutput | None:
        out = self._out
        if out.is_empty():
            return None
        self._out = KVConnectorOutput()
        return out


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)
