"""Test support: HF oracles, tiny checkpoints of the families the tests cover, tensor-parallel and browser helpers."""
