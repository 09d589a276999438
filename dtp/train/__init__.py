"""`dtp train`: tensor-parallel training on real text: data and tokenizers, the optimizer, the loop,
the meter, resuming, convergence parity across tp, the memory budget, and the session that runs it
all.

Imports `checkpoint`, `verify`, `runtime` and everything below them.
"""

from dtp.train.loop import TrainConfig, train
from dtp.train.session import train_command

__all__ = ["TrainConfig", "train", "train_command"]
