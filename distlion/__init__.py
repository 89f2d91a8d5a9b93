"""distlion: a benchmarking harness for communication-efficient distributed training.

Built around Distributed Lion (Liu et al. 2024, arXiv 2404.00438).
"""

from distlion.api import Simulation, StepResult
from distlion.methods import METHODS, Method, StepContext, build_method
from distlion.optim import DistributedLion

__all__ = ["METHODS", "DistributedLion", "Method", "Simulation", "StepContext", "StepResult", "build_method"]
