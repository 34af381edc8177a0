"""InputBatch == the straightforward per-step build (block tables from lists), across growth, preemption, drafts."""

import numpy as np
import torch

from vlserve.worker.input_batch import InputBatch


def _reference(block_ids: list[list[int]], windows, starts, bs):
    q = np.array([len(w) for w in windows])
    cu = np.concatenate([[0], np.cumsum(q)])
    table = np.zeros((len(block_ids), max(len(b) for b in block_ids)), dtype=np.int32)
    for i, b in enumerate(block_ids):
        table[i, : len(b)] = b
    pos, slots = [], []
    for i, (w, s) in enumerate(zip(windows, starts)):
        for j in range(len(w)):
            p = s + j
            pos.append(p)
            slots.append(int(table[i, p // bs]) * bs + p % bs)
    return [t for w in windows for t in w], pos, slots, cu, table


def _check(batch, req_ids, lists, windows, starts, bs=4):
    starts = np.array(starts, dtype=np.int64)
    q = np.array([len(w) for w in windows], dtype=np.int64)
    step = batch.prepare(req_ids, [t for w in windows for t in w], q, starts, None)
    ids, pos, slots, cu, table = _reference([lists[r] for r in req_ids], windows, starts, bs)
    md = step.attn_metadata
    assert step.input_ids.tolist() == ids
    assert step.positions_np.tolist() == pos
    assert md.slot_mapping.tolist() == slots
    assert md.query_start_loc.tolist() == cu.tolist() == md.query_start_loc_cpu
    assert md.seq_lens.tolist() == (starts + q).tolist() == md.seq_lens_cpu
    assert md.block_tables.tolist() == table.tolist()
    assert md.num_decodes == int((q == 1).sum()) and md.max_query_len == int(q.max())


def test_block_table_growth_preemption_and_spec_tokens():
    bs = 4
    # Tiny starting sizes so rows, block-table width and token buffers all have to grow.
    batch = InputBatch(bs, torch.device("cpu"), max_num_tokens=4, max_num_reqs=1, max_blocks_per_req=1)
    lists = {"a": [7, 3], "b": [9]}
    batch.add_request("a", (lists["a"],))
    batch.add_request("b", (lists["b"],))
    _check(batch, ["a", "b"], lists, [[11, 12, 13, 14, 15], [21, 22, 23]], [0, 0])  # two prefills
    # decode of a; b's chunk reaches into a new block, then carries two draft tokens past its known ones
    batch.append_blocks("b", ([5],))
    lists["b"].append(5)
    _check(batch, ["a", "b"], lists, [[16], [24, 25, 90, 91]], [5, 3])
    # b is preempted (row freed) and comes back with other blocks; a third request takes a row meanwhile
    batch.remove_request("b")
    lists["c"] = [2, 4, 6]
    batch.add_request("c", (lists["c"],))
    lists["b"] = [8, 1]
    batch.add_request("b", (lists["b"],))
    batch.append_blocks("a", ([0, 10],))
    lists["a"] += [0, 10]
    _check(batch, ["a", "c", "b"], lists, [[17], [31] * 9, [21, 22, 23, 24, 25]], [9, 0, 0])
    assert batch.block_ids("a") == ([7, 3, 0, 10],) and batch.block_ids("b") == ([8, 1],)
    batch.remove_request("a")
    batch.remove_request("missing")  # finished ids the runner never saw are ignored
    _check(batch, ["c", "b"], lists, [[32], [26]], [9, 5])  # the step table is re-gathered: stale rows gone


class _FakeEvent:
    """Stands in for torch.cuda.Event on CPU: counts records and waits."""

    def __init__(self):
        self.records = self.waits = 0

    def record(self):
        self.records += 1

    def synchronize(self):
        self.waits += 1


def test_host_buffers_wait_for_their_pending_copy_before_being_rewritten():
    """Off CPU each copy out of a pinned host buffer is non_blocking: the buffer records an event after it, and the
    next step's `prepare` (through `ensure`) waits on that event before writing the host side again; once only."""
    batch = InputBatch(4, torch.device("cpu"))
    buffers = [
        batch.input_ids,
        batch.positions,
        batch.query_start_loc,
        batch.seq_lens,
        *batch.slot_mappings,
        *batch.step_block_tables,
    ]
    for buf in buffers:  # what _allocate makes on CUDA: a device twin and an event
        buf.dev, buf.copied = torch.zeros_like(buf.host), _FakeEvent()
    batch.add_request("a", ([1, 2],))
    batch.prepare(["a"], [5, 6, 7], np.array([3]), np.array([0]), None)
    batch.positions_on_device(3)  # as the runner does for the model's positions
    assert all(buf.copied.records == 1 and buf.copy_pending for buf in buffers)
    assert all(buf.copied.waits == 0 for buf in buffers)
    step = batch.prepare(["a"], [8], np.array([1]), np.array([3]), None)
    assert all(buf.copied.waits == 1 for buf in buffers)  # each waited once before being rewritten
    assert step.input_ids.tolist() == [8] and step.positions_np.tolist() == [3]
