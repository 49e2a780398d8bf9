"""Serving engines as receivers: each loads its adapter by name (vllm.py: DCRWorkerExtension)."""
