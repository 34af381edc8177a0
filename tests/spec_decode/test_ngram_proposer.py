"""NgramProposer: hand cases, a brute-force cross-check, the list-buffer cache, and a printed timing."""

import time

import numpy as np
import pytest

from vlserve.spec_decode import NgramProposer, SpeculativeConfig


def brute(t, mn, mx, k, match="earliest"):
    """Literal definition: longest n in [mn, mx] whose suffix recurs earlier (followed by a token)."""
    L = len(t)
    for n in range(mx, mn - 1, -1):
        if n >= L:
            continue
        occ = [s for s in range(0, L - n) if t[s : s + n] == t[L - n :]]
        if occ:
            s = occ[0] if match == "earliest" else occ[-1]
            return t[s + n : s + n + k]
    return []


def test_no_match_is_empty():
    p = NgramProposer(1, 3, 4)
    assert p.propose([[1, 2, 3, 4, 5]]) == [[]]
    assert p.propose([[], [7], [7, 7]]) == [[], [], [7]]  # too short; [7, 7]: 7 recurs, followed by 7
    assert p.propose([]) == []
    # a 2-gram minimum: the last token recurs but not the last two
    assert NgramProposer(2, 3, 4).propose([[1, 2, 9, 5, 2]]) == [[]]


def test_longest_ngram_preferred():
    # suffix [1, 2, 3]: the 1-gram [3] occurs early (followed by 50), the 3-gram [1, 2, 3] later (followed by 60).
    seq = [3, 50, 8, 1, 2, 3, 60, 61, 9, 1, 2, 3]
    assert NgramProposer(1, 3, 2).propose([seq]) == [[60, 61]]
    assert NgramProposer(1, 1, 2).propose([seq]) == [[50, 8]]  # only 1-grams allowed: earliest occurrence of [3]
    # the 2-gram [2, 3] is the longest when max is 2; its earliest occurrence is at 4..5
    assert NgramProposer(1, 2, 2).propose([seq]) == [[60, 61]]


def test_earliest_vs_latest_occurrence():
    seq = [5, 6, 10, 11, 5, 6, 20, 21, 5, 6]
    assert NgramProposer(2, 2, 2).propose([seq]) == [[10, 11]]
    assert NgramProposer(2, 2, 2, match="latest").propose([seq]) == [[20, 21]]


def test_at_most_k_and_stops_at_sequence_end():
    seq = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert NgramProposer(2, 2, 3).propose([seq]) == [[3, 4, 5]]
    assert NgramProposer(2, 2, 10).propose([seq]) == [[3, 4, 5, 6, 7, 1, 2]]  # up to the end of the sequence
    # a periodic sequence: the earliest occurrence overlaps the suffix and runs to the end
    assert NgramProposer(2, 3, 10).propose([[4, 4, 4, 4]]) == [[4]]  # 3-gram at 0..2, then token 3
    assert NgramProposer(2, 2, 10).propose([[4, 4, 4, 4]]) == [[4, 4]]
    # max_model_len caps the drafts
    assert NgramProposer(2, 2, 3, max_model_len=11).propose([seq]) == [[3, 4]]
    assert NgramProposer(2, 2, 3, max_model_len=9).propose([seq]) == [[]]


def test_batch_and_numpy_inputs():
    seqs = [[1, 2, 3, 1, 2], [9, 9], [4, 5, 6], [7, 8, 7, 8, 7, 8]]
    exp = [[3, 1, 2], [9], [], [7, 8]]  # last: the 4-gram 7 8 7 8 at 0..3, then the sequence ends
    p = NgramProposer(1, 4, 3)
    assert p.propose(seqs) == exp
    assert p.propose([np.array(s, dtype=np.int64) for s in seqs]) == exp
    assert p.propose([np.array(s, dtype=np.int32) for s in seqs]) == exp


def test_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(400):
        B = int(rng.integers(1, 6))
        V = int(rng.integers(1, 5))
        seqs = [rng.integers(0, V, int(rng.integers(0, 30))).tolist() for _ in range(B)]
        mn = int(rng.integers(1, 4))
        mx = mn + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        for match in ("earliest", "latest"):
            exp = [brute(s, mn, mx, k, match) for s in seqs]
            p = NgramProposer(mn, mx, k, match=match)
            assert p.propose(seqs) == exp, (seqs, mn, mx, k, match)
            assert p.propose(seqs, req_ids=[f"r{i}" for i in range(B)]) == exp


def test_buffer_cache_follows_growing_lists():
    p = NgramProposer(1, 3, 2)
    a, b = [1, 2, 3, 4], [5, 6, 5]
    assert p.propose([a, b], req_ids=["a", "b"]) == [[], [6, 5]]
    a += [1, 2]  # appends are picked up
    b.append(7)
    assert p.propose([a, b], req_ids=["a", "b"]) == [[3, 4], []]
    a.extend(range(100, 300))  # past the buffer's capacity
    a += [1, 2, 3]
    assert p.propose([a], req_ids=["a"]) == [[4, 1]]
    # a different list under the same id (shrunk / changed) is rebuilt, not appended to
    assert p.propose([[8, 9, 8]], req_ids=["a"]) == [[9, 8]]
    assert p.propose([[8, 9, 1, 2, 1]], req_ids=["a"]) == [[2, 1]]
    p.remove_requests(["a", "b", "unknown"])
    assert p._buffers == {}


def test_from_config():
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    )
    p = NgramProposer.from_config(c, max_model_len=100)
    assert (p.min_n, p.max_n, p.k, p.max_model_len) == (2, 3, 4, 100)
    with pytest.raises(ValueError):
        NgramProposer(3, 2, 1)


def _text_like(rng, L, V=32000):
    x = rng.permutation(V)[rng.zipf(1.2, L) % V]  # Zipf-ish token frequencies
    for _ in range(5):  # plus some copied spans
        s, d = rng.integers(0, L - 50, 2)
        x[d : d + 30] = x[s : s + 30]
    return x.astype(np.int64)


def test_speed_printed():
    """64 requests x 1-2k tokens. Printed, not asserted (shared CI cores)."""
    rng = np.random.default_rng(0)
    arrays = [_text_like(rng, int(rng.integers(1000, 2001))) for _ in range(64)]
    lists = [a.tolist() for a in arrays]
    ids = [f"r{i}" for i in range(64)]
    for mn, mx in ((1, 3), (2, 5), (5, 5)):
        p = NgramProposer(mn, mx, 5)
        res = {}
        for name, inp, kw in (("numpy", arrays, {}), ("lists+req_ids", lists, {"req_ids": ids}), ("lists", lists, {})):
            p.propose(inp, **kw)
            ts = []
            for it in range(15 if name != "lists" else 3):
                if kw:
                    for lst in lists:
                        lst.append(lst[-40 + it])  # one new token per step, as in decoding
                t0 = time.perf_counter()
                p.propose(inp, **kw)
                ts.append(time.perf_counter() - t0)
            res[name] = f"{min(ts) * 1e3:.2f}/{float(np.median(ts)) * 1e3:.2f}ms"
        print(f"\n[ngram speed] 64 reqs x 1-2k tokens, min_n={mn} max_n={mx} k=5 (min/median): {res}")
