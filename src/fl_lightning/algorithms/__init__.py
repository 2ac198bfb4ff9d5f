"""Server-side algorithms, by family. Configs name them by class, e.g. ``algorithm: {class_path:
FedProx, init_args: {mu: 0.01}}``.

- this folder: the base (``base.py``: ``Algorithm`` and ``FedAvg``), a client's round
  (``client.py``), the served-statistics part (``bn_protocol.py``), serving by budget
  (``levels.py``, ``level_report.py``) and the plain FL methods (FedOpt, FedProx, SCAFFOLD, FedDyn, FedMut);
- ``submodel/``: width slices per client (HeteroFL, FjORD, Uniform, Random-budget, HAS-FL, FedRolex);
- ``supernet/``: FEAST and its baselines (FIARSE, ScaleFL, SuperFedNAS, DeepFedNAS);
- ``split/``: split FL (SplitFed, FedSGA, MergeSFL, MU-SplitFed, MultiSFL);
- ``personalized/``: FedBABU, FedGH, FedAS.
"""

from fl_lightning.algorithms.base import Algorithm, RunContext
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.feddyn import FedDyn
from fl_lightning.algorithms.fedmut import FedMut
from fl_lightning.algorithms.fedopt import FedOpt
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.personalized.fedas import FedAS
from fl_lightning.algorithms.personalized.fedbabu import FedBABU
from fl_lightning.algorithms.personalized.fedgh import FedGH
from fl_lightning.algorithms.scaffold import Scaffold
from fl_lightning.algorithms.split.fedsga import FedSGA
from fl_lightning.algorithms.split.mergesfl import MergeSFL
from fl_lightning.algorithms.split.multisfl import MultiSFL
from fl_lightning.algorithms.split.musplitfed import MUSplitFed
from fl_lightning.algorithms.split.splitfed import SplitFed
from fl_lightning.algorithms.submodel import HASFL, FedRolex, FjORD, HeteroFL, RandomBudget, SubmodelAlgorithm, Uniform
from fl_lightning.algorithms.supernet.cached_variants import CacheSearch
from fl_lightning.algorithms.supernet.feast import Feast
from fl_lightning.algorithms.supernet.fednas import DeepFedNAS, SuperFedNAS
from fl_lightning.algorithms.supernet.fiarse import FIARSE
from fl_lightning.algorithms.supernet.scalefl import ScaleFL

__all__ = ["Algorithm", "FedAvg", "FedOpt", "FedProx", "Scaffold", "FedDyn", "Feast", "CacheSearch", "RunContext",
           "SubmodelAlgorithm", "HeteroFL", "FedRolex", "FjORD", "Uniform", "RandomBudget", "HASFL",
           "SplitFed", "FedSGA", "FedBABU", "FedGH", "FedAS", "FedMut", "MergeSFL", "MUSplitFed", "MultiSFL",
           "SuperFedNAS", "DeepFedNAS", "ScaleFL", "FIARSE"]
