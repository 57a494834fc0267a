"""Benchmarks: decode latency, throughput and memory per KV policy, with the memory-bandwidth roofline."""
