"""dtp's benchmarks (`dtp bench`): scaling with interleaved arms next to a Megatron-style baseline, fuzz
throughput, and the GPU check (`dtp bench --device cuda`)."""
