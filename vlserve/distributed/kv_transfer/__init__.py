"""KV transfer (vLLM v1's `vllm/distributed/kv_transfer`): one KV-connector interface (`base.py`), split as vlserve
is split (a scheduler side in pure Python, a worker side next to the runner's KV tensors), a factory that builds the
connector a `KVTransferConfig` names (`factory.py`), and the connectors (`offloading/`: a host-memory and disk tier
below the device KV pool)."""
