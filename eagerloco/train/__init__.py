"""Training runs: one trainer (:mod:`.trainer`) driving the workers of one of four runtimes; one output path."""

from eagerloco.config import TrainConfig
from eagerloco.train.run import RUNTIMES, train

__all__ = ["RUNTIMES", "TrainConfig", "train"]
