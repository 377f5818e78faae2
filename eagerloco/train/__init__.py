"""Training runs: one loop (:mod:`.loop`) driven in-process, on processes, or elastically; one output path."""

from eagerloco.config import TrainConfig
from eagerloco.train.distributed import in_distributed_env, train_distributed
from eagerloco.train.inprocess import train
from eagerloco.train.outputs import SUMMARY_KEYS

__all__ = ["SUMMARY_KEYS", "TrainConfig", "in_distributed_env", "train", "train_distributed"]
