"""Encoder-cache connectors (vLLM's EC connector): encoder outputs shared between engines."""
