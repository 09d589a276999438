"""`dtp train`: tensor-parallel training on real text (data, init, optimizer, loop, CLI)."""
