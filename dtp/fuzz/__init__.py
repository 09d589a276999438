"""Property-based fuzzing of sharding correctness (`dtp fuzz`)."""
