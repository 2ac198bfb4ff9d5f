"""Server-side algorithms. Configs name them by class, e.g. ``algorithm: {class_path: FedProx, init_args: {mu: 0.01}}``."""

from fl_lightning.algorithms.base import Algorithm, FedAvg, RunContext
from fl_lightning.algorithms.fedas import FedAS
from fl_lightning.algorithms.fedbabu import FedBABU
from fl_lightning.algorithms.fedgh import FedGH
from fl_lightning.algorithms.fedmut import FedMut
from fl_lightning.algorithms.fednas import DeepFedNAS, SuperFedNAS
from fl_lightning.algorithms.fedopt import FedOpt
from fl_lightning.algorithms.fedrolex import FedRolex
from fl_lightning.algorithms.fiarse import FIARSE
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.cached_variants import CacheSearch
from fl_lightning.algorithms.feast import Feast
from fl_lightning.algorithms.fedsga import FedSGA
from fl_lightning.algorithms.mergesfl import MergeSFL
from fl_lightning.algorithms.multisfl import MultiSFL
from fl_lightning.algorithms.musplitfed import MUSplitFed
from fl_lightning.algorithms.scaffold import Scaffold
from fl_lightning.algorithms.scalefl import ScaleFL
from fl_lightning.algorithms.splitfed import SplitFed
from fl_lightning.algorithms.submodel import HASFL, FjORD, HeteroFL, RandomBudget, SubmodelAlgorithm, Uniform

__all__ = ["Algorithm", "FedAvg", "FedOpt", "FedProx", "Scaffold", "Feast", "CacheSearch", "RunContext",
           "SubmodelAlgorithm", "HeteroFL", "FedRolex", "FjORD", "Uniform", "RandomBudget", "HASFL",
           "SplitFed", "FedSGA", "FedBABU", "FedGH", "FedAS", "FedMut", "MergeSFL", "MUSplitFed", "MultiSFL",
           "SuperFedNAS", "DeepFedNAS", "ScaleFL", "FIARSE"]
