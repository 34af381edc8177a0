"""The rejection-sampler tests run many small ops: the same one-thread fixture as tests/spec_decode."""

from tests.spec_decode.conftest import _one_torch_thread  # noqa: F401  (autouse fixture, registered here too)
