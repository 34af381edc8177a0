"""P2P KV transfer (disaggregated prefill / decode) over Mooncake's Transfer Engine."""
