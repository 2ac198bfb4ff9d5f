"""Golden values for SuperFedNAS from the authors' code (gatech-sysml/superfednas).

    pip install --no-deps --target <dir> ofa==0.1.0.post202307202001   # OFA, which SuperFedNAS imports
    PYTHONPATH=src:<dir> OMP_NUM_THREADS=1 python tools/reference/superfednas.py /path/to/superfednas

Case (``tests/reference_fednas_case.py``): our unconstrained SuperFedNAS transfer on a two-stage
``ofa_resnet`` equal to the authors' ResNet-10-26 supernet (``elastic_nn/ofa_resnets_32x32_10_26.py:
OFAResNets32x32_10_26``, the ``ofaresnet50_32x32_10_26`` model of their published commands) at
a reduced size, 3 clients (all of them every round), two rounds. The authors' side is their own
round: ``Server/ServerTrainer/superfednas_trainer.py: FLOFA_Trainer.train_one_round`` (cohort,
``update_sample``, ``maxnet_cos_all_subnet``, the ``TS_all_random`` sampler, ``SubnetTrainer.train``
per client, ``_aggregate`` with ``ServerResnet_10_26.add_subnet``), run twice from our initial
supernet, each client fed the batches our loop drew for it in that round.

Reduced size: their network hard-codes four stages of base widths 256-2048
(``ResNets32x32_10_26.STAGE_WIDTH_LIST``, ``BASE_DEPTH_LIST``) and OFA's channel divisor 8
(``MyNetwork.CHANNEL_DIVISIBLE``); these class constants are set to two stages of 80 and 96 and
divisor 4 before the supernet is built (their code is otherwise run as is).

Stand-ins (documented in the provenance): ``wandb`` (logging; ``wandb.run`` a disabled run, so
``save`` returns at once); the packages' ``__init__`` files (they import the DARTS, TCN and
MobileNet models; the modules used are imported directly); the sampler's architectures for the
min role and the random role. Their ResNet-10-26 samplers never set a width (``w`` stays
``None``, i.e. the widest): ``min_subnet_arch`` is depth 0, expansion 0.1 at full width and
``random_subnet_arch`` draws depths and per-block expansions only (with ``np.random`` seeded by
round + client). The transfer samples FEAST's space, whose smallest architecture is also the
narrowest and whose random draws include widths; so ``min_subnet_arch`` returns the narrowest
smallest architecture and ``random_subnet_arch`` our draw. The round's evaluation of all
clients' test sets (``_efficient_local_test_on_all_clients``) is skipped, its checkpoint-subnet
pass runs on one test batch.
"""

from __future__ import annotations

import argparse

import torch

import common
import fednas_rounds as fr
from reference_fednas_case import INPUT, MAXNET_STEPS, NUM_CLASSES, SFN_MODEL

STAGE_WIDTHS = list(SFN_MODEL["init_args"]["stage_channels"])
DIVISOR = SFN_MODEL["init_args"]["divisor"]
BLOCKS = SFN_MODEL["init_args"]["max_extra_blocks"] + 1
INIT_PARAMS = {"n_classes": NUM_CLASSES, "depth_list": list(range(BLOCKS)),
               "expand_ratio_list": [0.1, 0.14, 0.18, 0.22, 0.25],
               "width_mult_list": list(SFN_MODEL["init_args"]["width_multipliers"])}
SCHEDULE = {"type": "maxnet_cos_all_subnet", "num_steps": MAXNET_STEPS, "init": 0.9, "final": 0.125}
PACKAGES = ("fedml_api.standalone.superfednas.Server.ServerModel",
            "fedml_api.standalone.superfednas.Server.ServerTrainer",
            "fedml_api.standalone.superfednas.Client.ClientTrainer")


def reference_arch(spec: dict) -> dict:
    """Our (stage-level) architecture in their encoding: one expansion per block, width indexes."""
    return {"d": list(spec["d"]), "e": [e for e in spec["e"] for _ in range(BLOCKS)], "w": list(spec["w"])}


def authors(repo, case) -> dict:
    fr.stub_wandb()
    fr.bypass_package_init(repo, *PACKAGES)
    from ofa.utils import MyNetwork

    from fedml_api.standalone.superfednas.Client.ClientTrainer.subnet_trainer import SubnetTrainer
    from fedml_api.standalone.superfednas.elastic_nn.ofa_resnets_32x32_10_26 import ResNets32x32_10_26
    from fedml_api.standalone.superfednas.Server.ServerModel.server_resnet_32x32_10_26 import ServerResnet_10_26
    from fedml_api.standalone.superfednas.Server.ServerTrainer.superfednas_trainer import FLOFA_Trainer

    ResNets32x32_10_26.STAGE_WIDTH_LIST = STAGE_WIDTHS
    ResNets32x32_10_26.BASE_DEPTH_LIST = [1] * len(STAGE_WIDTHS)
    MyNetwork.CHANNEL_DIVISIBLE = DIVISOR
    model = case["model"]
    assert tuple(INIT_PARAMS["expand_ratio_list"]) == tuple(model.expansions)

    server = ServerResnet_10_26(dict(INIT_PARAMS), "TS_all_random", fr.CLIENTS)
    fr.load_ours_into(server, case["initial"], BLOCKS)
    agree = fr.check_same_functions(server, model, case, reference_arch, INPUT)

    draws = [reference_arch(t["spec"]) for rnd in case["rounds"] for t in rnd["tasks"] if t["role"] == "random"]
    smallest = reference_arch({"d": [0] * len(STAGE_WIDTHS), "e": [min(model.expansions)] * len(STAGE_WIDTHS),
                               "w": [0] * (len(STAGE_WIDTHS) + 1)})
    theirs = {"min_subnet_arch": server.min_subnet_arch(), "max_subnet_arch": server.max_subnet_arch()}
    server.random_subnet_arch = lambda: draws.pop(0)
    server.min_subnet_arch = lambda: dict(smallest, e=list(smallest["e"]))

    args = fr.trainer_args(SCHEDULE, ckpt_subnets=[server.max_subnet_arch()], use_bn=not case["frozen_bn"],
                           model="ofaresnet50_32x32_10_26")
    client_trainer = SubnetTrainer(None, torch.device("cpu"), args)
    trainer = FLOFA_Trainer(server, fr.dataset_list(case), client_trainer, args, None,
                            wt_avg_sched_method="maxnet_cos_all_subnet")
    test_batch = case["batches"][(0, 0)][0]
    record = fr.drive(trainer, server, client_trainer, case, test_batch)
    assert not draws, "a random draw was left unused"
    return fr.golden(case, record, BLOCKS, {"same_function": agree, **theirs})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("repo")
    parser.add_argument("--commit", default=None, help="the commit a folder extracted by git archive comes from")
    args = parser.parse_args()
    repo = common.add_repo(args.repo)
    fr.record("superfednas", authors, repo)
    import importlib.metadata as md

    common.write_provenance(
        "superfednas", repo, commit=args.commit, repository="https://github.com/gatech-sysml/superfednas",
        used=["fedml_api/standalone/superfednas/Server/ServerTrainer/superfednas_trainer.py: FLOFA_Trainer.__init__ "
              "(line 35), _client_sampling (144), _aggregate (160), train_one_round (205), maxnet_cos_all_subnet (899)",
              "fedml_api/standalone/superfednas/Server/ServerModel/base_server_model.py: BaseServerModel.update_sample "
              "(59), tracking_sandwich_all_subnet_sample (227, TS_all_random)",
              "fedml_api/standalone/superfednas/Server/ServerModel/server_resnet_32x32_10_26.py: ServerResnet_10_26."
              "active_subnet_index (37), get_subnet (69), add_subnet (86), is_max_net (156), is_min_net (166), "
              "max_subnet_arch (177)",
              "fedml_api/standalone/superfednas/Client/ClientTrainer/subnet_trainer.py: SubnetTrainer.train (21), "
              "test (169)",
              "fedml_api/standalone/superfednas/Client/ClientModel/client_model.py: ClientModel",
              "fedml_api/standalone/superfednas/elastic_nn/ofa_resnets_32x32_10_26.py: NewResidualBlock (160), "
              "DynamicResidualBlock (316), OFAResNets32x32_10_26 (530; set_active_subnet 700, get_active_subnet 757)"],
        notes="Synthetic 3x8x8 images, 4 classes, 3 iid clients of 24 examples, all 3 every round, 2 rounds; their "
              "ResNet-10-26 supernet with STAGE_WIDTH_LIST " + str(STAGE_WIDTHS) + ", BASE_DEPTH_LIST [1, 1], "
              "MyNetwork.CHANNEL_DIVISIBLE " + str(DIVISOR) + " (class constants set before building), init params "
              + str(INIT_PARAMS) + " (our ofa_resnet with the same widths, round_middle true); SGD lr 0.05, "
              "momentum 0 (their SubnetTrainer has none), weight decay 5e-4, max_norm 3.0, kd_ratio 0, one "
              "epoch of batch 8 on the batches our loop drew; weighted_avg_schedule " + str(SCHEDULE) + "; twice: use_bn "
              "(authors*.pt; ours frozen_bn false) and without it, their default, batch norm held at the identity "
              "(authors_frozen*.pt; ours frozen_bn true). "
              "Stand-ins: wandb (logging; wandb.run a disabled run); the ServerModel, ServerTrainer and ClientTrainer "
              "package __init__ files bypassed (they import DARTS/TCN/MobileNet); min_subnet_arch returns the "
              "narrowest smallest architecture (theirs keeps full width) and random_subnet_arch our random-role "
              "draw (theirs draws depths and per-block expansions only); _efficient_local_test_on_all_clients "
              "skipped (evaluation). ofa " + md.version("ofa") + " (PyPI, installed with --no-deps).",
        ofa=md.version("ofa"),
        setup="pip install --no-deps --target <dir> ofa==" + md.version("ofa") + "; then PYTHONPATH=src:<dir> "
              "OMP_NUM_THREADS=1 before the command")


if __name__ == "__main__":
    main()
