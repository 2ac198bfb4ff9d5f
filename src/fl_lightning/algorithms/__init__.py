"""Server-side algorithms. Configs name them by class, e.g. ``algorithm: {class_path: FedProx, init_args: {mu: 0.01}}``."""

from fl_lightning.algorithms.base import Algorithm, FedAvg, RunContext
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.feast import CacheSearch, Feast
from fl_lightning.algorithms.fedsga import FedSGA
from fl_lightning.algorithms.scaffold import Scaffold
from fl_lightning.algorithms.splitfed import SplitFed
from fl_lightning.algorithms.submodel import HASFL, FjORD, HeteroFL, RandomBudget, SubmodelAlgorithm, Uniform

__all__ = ["Algorithm", "FedAvg", "FedProx", "Scaffold", "Feast", "CacheSearch", "RunContext",
           "SubmodelAlgorithm", "HeteroFL", "FjORD", "Uniform", "RandomBudget", "HASFL",
           "SplitFed", "FedSGA"]
