"""The P2P connector's transfer agent: two Mooncake engines in one process, each over a tiny KV cache; a batched
read moves blocks (runs merged, scattered ids too) byte for byte; a different layout is refused."""

from __future__ import annotations

import pytest
import torch


def caches(num_blocks=12, layers=2, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(num_blocks, 4, 2, 8, generator=g).to(dtype) for _ in range(2)) for _ in range(layers)]


def test_read_blocks_between_two_agents(mooncake):
    from vlserve.distributed.kv_transfer.p2p.agent import CacheDescriptor, TransferAgent

    prod, cons = caches(seed=1), caches(seed=2)
    before = [tuple(t.clone() for t in pair) for pair in cons]
    a, b = TransferAgent(), TransferAgent()
    a.register(prod)
    b.register(cons)
    peer = CacheDescriptor.from_dict(a.describe().to_dict())  # as it travels (JSON-able)
    remote, local = [3, 4, 5, 9, 1], [0, 1, 2, 7, 11]
    assert b.read_blocks(peer, remote, local)
    for (pk, pv), (ck, cv), (bk, bv) in zip(prod, cons, before):
        for r, l in zip(remote, local):
            assert torch.equal(ck[l], pk[r]) and torch.equal(cv[l], pv[r])
        untouched = [i for i in range(12) if i not in local]
        assert torch.equal(ck[untouched], bk[untouched]) and torch.equal(cv[untouched], bv[untouched])
    a.close()
    b.close()


def test_layout_mismatch_and_bad_ids_refused(mooncake):
    from vlserve.distributed.kv_transfer.p2p.agent import TransferAgent

    a, b = TransferAgent(), TransferAgent()
    a.register(caches(layers=2))
    b.register(caches(layers=3))
    with pytest.raises(ValueError, match="layout differs"):
        b.read_blocks(a.describe(), [0], [0])
    c = TransferAgent()
    c.register(caches(layers=2))
    with pytest.raises(ValueError, match="out of range"):
        c.read_blocks(a.describe(), [12], [0])
