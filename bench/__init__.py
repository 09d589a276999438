"""dtp's benchmarks: scaling next to a Megatron-style baseline, and fuzz throughput (`dtp bench`)."""
