"""The offloading connector (vLLM's OffloadingConnector): a host-memory KV tier and a disk tier below the device
KV pool, keyed by stable block keys (`keys.py`). `connector.py` is the scheduler side (pure Python) and the
worker-side entry; `tier_store.py` (torch) holds the host buffer and reads / writes the disk files."""
