"""FedSGA: sufficiency-guided adaptive split FL with interface harmonization.

A split model with a cut chosen per client and round from the candidate set P, trained on one
shared server model (clients in plan order, SplitFed V2's engine; ``server_model: copy`` runs
SplitFed V1 underneath instead):

- private prompt tokens per client (``modules/prompts.py``), kept in the server's per-client
  store, trained by the client's optimizer only, never aggregated;
- descriptors (semantic alignment, temporal stability, prompt-state variation) on a fixed
  probe batch after each client fit, and the estimator Gamma_theta of the probability that the
  shallowest cut suffices, trained on calibration labels ``L(p1) <= (1 + beta) L(p_ref)``
  every ``calibration_every`` rounds, the probe losses of the model the round received, on
  held-out examples (``modules/sufficiency.py``);
- the monotone, budget-aware policy Psi from that probability to a cut;
- the depth-aware interface harmonizer with EMA class prototypes at the server
  (``modules/harmonizer.py``): its alignment loss regularizes the server half's, whose own
  classifier predicts (an additive read-out of the harmonized interface is an option).

Every formula and the choices the paper leaves open: docs/fedsga.md.
"""

from __future__ import annotations

from typing import Dict, List, Literal, Optional

import torch
from torch import nn

from fl_lightning.algorithms.split.fedsga_client import CutChoice, FedSGAClient, FedSGAParts, FedSGASettings
from fl_lightning.algorithms.split.common import default_candidates
from fl_lightning.algorithms.split.splitfed import SplitFed
from fl_lightning.errors import ConfigError
from fl_lightning.modules.harmonizer import averaged_tensors
from fl_lightning.option_types import ClosedUnitInterval, NonNegativeFloat, PositiveFloat, PositiveInt, number_type
from fl_lightning.runtime.client_store import ClientStateStore
from fl_lightning.runtime.kept_state import KeptAttributes, KeptModule
from fl_lightning.runtime.link import Downlink
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.seeding import derive_seed

Strategy = Literal["sufficiency", "static", "random"]
Readout = Literal["server_head", "additive", "additive_bias"]
ServerModel = Literal["shared", "copy"]
PromptGradient = Literal["task", "all"]
ProbeSize = number_type(int, ge=2)
# seed streams: probe batches, random splits, harmonizer and estimator initialization
PROBE_STREAM, SPLIT_STREAM, INIT_STREAM = 22, 23, 24


class FedSGA(SplitFed):
    """Sufficiency-guided adaptive split FL (a shared server model underneath by default)."""

    def __init__(self, candidates: Optional[List[str]] = None, split_strategy: Strategy = "sufficiency",
                 static_cut: Optional[str] = None, adaptation_channel: bool = True,
                 sufficiency_estimator: bool = True, harmonizer: bool = True, server_model: ServerModel = "shared",
                 readout: Readout = "server_head", prompt_gradient: PromptGradient = "all",
                 eval_cut: Optional[str] = None, num_prompts: PositiveInt = 4,
                 prompt_width: PositiveInt = 4, rho: NonNegativeFloat = 0.1, beta: NonNegativeFloat = 0.05,
                 lambda_align: NonNegativeFloat = 0.1, tau_a: PositiveFloat = 0.5, tau_m: PositiveFloat = 0.5,
                 prototype_momentum: ClosedUnitInterval = 0.9, projection_dim: PositiveInt = 128,
                 calibration_every: PositiveInt = 5, probe_size: ProbeSize = 32,
                 estimator_hidden: PositiveInt = 16, estimator_buffer: PositiveInt = 256,
                 respect_budgets: bool = True, server_lr: Optional[PositiveFloat] = None, **kwargs):
        """
        Args:
            candidates: candidate cuts P (block names, shallowest first); None: the stage ends
                (ResNet) or the quarter points (ViT), see docs/fedsga.md. p1 is the first,
                p_ref the middle one.
            split_strategy: sufficiency (estimator and policy), static (everyone at
                ``static_cut``) or random (uniform over the affordable candidates): Fig. 4.
            static_cut: the static strategy's cut (None: p_ref).
            adaptation_channel: train private prompt tokens (false: the "w/o Adapt." ablation).
            sufficiency_estimator: use Gamma_theta (false: the "w/o Suff. Est." ablation, a
                hand-crafted score of the same descriptors).
            harmonizer: interface harmonization acts on the model: its alignment loss reaches
                the backbone (and with an additive ``readout`` its representation enters the
                prediction). false: the "w/o Harmon." ablation (plain cross-entropy at the
                server).
            server_model: shared (one server model trained client by client in plan order, the
                paper's Sec. 1 and 3) or copy (SplitFed V1: a server copy per client, averaged).
            readout: what predicts at the server. server_head: the server half's own classifier,
                ``back(z)``, the harmonizer aligning and regularizing (the paper's Sec. 3.4, which
                describes prototype-based regularization and no read-out head). additive:
                ``back(z) + W Z`` with ``Z = phi(pool(z), e(p))``, a bias-free linear read-out of
                the harmonized interface on the prediction path (ours). additive_bias: the same
                with a bias, whose gradient equals the classifier bias's (ours; the class prior
                then moves twice as fast under label skew: docs/results/fedsga.md).
            prompt_gradient: what trains the prompt: all (every server loss term, standard
                backpropagation, Sec. 3.5) or task (the server's task loss only; the alignment
                term's gradient is kept from it, at one more backward of the front).
            eval_cut: the cut at which the served model is evaluated with an additive read-out
                (None: p_ref); every candidate's accuracy is logged too.
            num_prompts: prompt tokens per client, m.
            prompt_width: border width in pixels of the input-side prompt (CNN backbones).
            rho: split-policy parameter (larger: deeper splits).
            beta: shallow-sufficiency margin.
            lambda_align: weight of the prototype alignment loss.
            tau_a: prototype temperature.
            tau_m: prompt contribution temperature.
            prototype_momentum: EMA coefficient mu of the class prototypes.
            projection_dim: width of the harmonizer's shared semantic space.
            calibration_every: rounds between calibrations (rounds 1, 1 + k, 1 + 2k, ...).
            probe_size: examples in each client's fixed probe batch (at least 2): the first half
                fits the depth probes, the second half labels the calibration.
            estimator_hidden: hidden width of Gamma_theta.
            estimator_buffer: calibration pairs Gamma_theta is trained on (the most recent).
            respect_budgets: cap each client's cut at the deepest one whose client forward MACs
                fit its budget (partition.budgets): Psi is budget-aware (Sec. 3.5, 5).
            server_lr: learning rate of the server half (None: the clients' round rate).
            **kwargs: SplitFed's served-statistics options (``bn``, default sbn: docs/served_statistics.md).
        """
        super().__init__(cut=None, version="v2" if server_model == "shared" else "v1", server_lr=server_lr, **kwargs)
        self.candidates = candidates
        self.split_strategy = split_strategy
        self.static_cut = static_cut
        self.adaptation_channel = adaptation_channel
        self.use_estimator = sufficiency_estimator
        self.use_harmonizer = harmonizer
        self.server_model = server_model
        self.readout = readout
        self.prompt_gradient = prompt_gradient
        self.eval_cut = eval_cut
        self.num_prompts = num_prompts
        self.prompt_width = prompt_width
        self.rho, self.beta, self.lambda_align = rho, beta, lambda_align
        self.tau_a, self.tau_m = tau_a, tau_m
        self.prototype_momentum = prototype_momentum
        self.projection_dim = projection_dim
        self.calibration_every = calibration_every
        self.probe_size = probe_size
        self.estimator_hidden = estimator_hidden
        self.estimator_buffer = estimator_buffer
        self.respect_budgets = respect_budgets

    @property
    def harmonized(self) -> bool:
        """The harmonized interface is on the server's prediction path."""
        return self.use_harmonizer and self.readout != "server_head"

    # -- set-up ---------------------------------------------------------------------------------
    def candidate_cuts(self, model: nn.Module) -> List[str]:
        names = list(model.block_names)
        cuts = list(self.candidates) if self.candidates is not None else default_candidates(names)
        for cut in cuts:
            self._check_cut("algorithm.candidates", cut, names)
        if len(cuts) < 2 or len(set(cuts)) != len(cuts):
            raise ConfigError("algorithm.candidates", f"needs at least two distinct cuts, got {cuts}")
        if [names.index(c) for c in cuts] != sorted(names.index(c) for c in cuts):
            raise ConfigError("algorithm.candidates", f"must be listed shallowest first, got {cuts}")
        for key in ("static_cut", "eval_cut"):
            value = getattr(self, key)
            if value is not None and value not in cuts:
                raise ConfigError(f"algorithm.{key}", f"must be one of the candidates {cuts}, got {value!r}")
        return cuts

    def prepare(self, ctx) -> None:
        from fl_lightning.modules.harmonizer import InterfaceHarmonizer, pool_interface
        from fl_lightning.modules.prompts import PromptChannel
        from fl_lightning.modules.sufficiency import DepthProbes, SufficiencyEstimator

        super().prepare(ctx)
        device = ctx.fabric.device
        self.ref_index = (len(self.cuts) - 1) // 2
        self.client_settings = FedSGASettings(self.adaptation_channel, self.use_harmonizer, self.harmonized,
                                              self.lambda_align, self.blocks_alignment_from_prompt,
                                              self.tau_m, self.ref_index, self.num_prompts,
                                              self.version == "v1" and self.use_harmonizer)
        self.static_index = self.cuts.index(self.static_cut) if self.static_cut is not None else self.ref_index
        self.eval_index = self.cuts.index(self.eval_cut) if self.eval_cut is not None else self.ref_index
        input_shape = tuple(ctx.data.bundle.input_shape)
        model = ctx.model
        try:
            self.prompts = PromptChannel(model.split(self.cuts[0])[0], input_shape, self.num_prompts,
                                         self.prompt_width, getattr(model, "embed_dim", None))
        except ValueError as error:
            raise ConfigError("algorithm.prompt_width", str(error)) from None
        with torch.no_grad():
            was_training = model.training
            model.eval()
            x = torch.zeros(1, *input_shape, device=device)
            widths = [pool_interface(model.split(cut)[0](x)).shape[1] for cut in self.cuts]
            model.train(was_training)
        self.widths = widths

        def harmonizer():
            return InterfaceHarmonizer(widths, ctx.num_classes, self.projection_dim, tau=self.tau_a,
                                       momentum=self.prototype_momentum, head=self.harmonized,
                                       head_bias=self.readout == "additive_bias").to(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(ctx.seed, INIT_STREAM))
            self.harmonizer = harmonizer()
            self.estimator = SufficiencyEstimator(self.estimator_hidden)
            self.probed = sorted({0, self.ref_index})  # the depths the calibration and descriptor read
            self.probes = DepthProbes({d: widths[d] for d in self.probed}, ctx.num_classes).to(device)
        self.harmonizer_worker = harmonizer()  # the server half's, loaded for each client's round
        self.client_parts = FedSGAParts(self.cuts, self.probed, self.prompts, self.harmonizer_worker)
        self.pairs = torch.zeros(0, 4, dtype=torch.float64)
        for prefix, part in (("harmonizer/", self.harmonizer), ("estimator/", self.estimator), ("probes/", self.probes)):
            self.keep(KeptModule(prefix, part))
        self.keep(KeptAttributes(self, {"calibration_pairs": "pairs"}, torch.float64))
        probe = min(self.probe_size, min(ctx.client_sizes))
        self._fit_rows = (probe + 1) // 2  # the probe batch's first half fits the probes, the rest labels
        self.store = self.keep(ClientStateStore(lambda: {
            "prompt": self.prompts.initial(device),
            "descriptor": torch.zeros(3, device=device),
            "has_descriptor": torch.zeros(1, device=device),
            "probe_features": torch.zeros(probe, widths[0], device=device),
        }))
        self._probe_count = probe
        self._probes: Dict[int, tuple] = {}
        self.afford = self._affordable(ctx)

    def _affordable(self, ctx) -> Optional[List[int]]:
        """Per client, the deepest candidate index whose client forward fits its budget."""
        if not self.respect_budgets:
            return None
        if ctx.budgets is None:
            raise ConfigError("algorithm.respect_budgets", "the partition assigns no client budgets")
        macs = [self.halves.front_macs[c] for c in self.cuts]
        poor = [i for i, b in enumerate(ctx.budgets.tolist()) if b < macs[0]]
        if poor:
            raise ConfigError("algorithm.respect_budgets",
                              f"{len(poor)} clients (e.g. {poor[:3]}) cannot afford the shallowest cut "
                              f"{self.cuts[0]} ({macs[0] / 1e6:.2f}M MACs); raise partition.budgets.b_min "
                              f"or set respect_budgets: false")
        return [max(k for k, m in enumerate(macs) if m <= b) for b in ctx.budgets.tolist()]

    def new_accumulator(self, plan):
        """Besides the model: the harmonizer's averaged tensors and their weight (server
        copies: every client's, sample-weighted; the shared server: the one harmonizer, from the
        rank that trained it), the prototypes' class sums and counts, the calibration pairs,
        every client's probe interfaces, and the clients' new store entries."""
        acc = super().new_accumulator(plan)
        h = self.harmonizer
        n = self.ctx.num_clients
        for name, value in averaged_tensors(h).items():
            acc.declare(f"harmonizer/{name}", torch.zeros_like(value))
        acc.declare("harmonizer/weight", torch.zeros(()))
        acc.declare("prototypes/sums", torch.zeros_like(h.prototypes))
        acc.declare("prototypes/counts", torch.zeros(h.prototypes.shape[0]))
        acc.declare("calibration/descriptors", torch.zeros(n, 4))  # the plan's descriptor and a flag
        for d in self.probed:
            acc.declare(f"probe/rows{d}", torch.zeros(n, self._probe_count, self.widths[d]))
        acc.declare("probe/mask", torch.zeros(n))
        acc.register("clients", self.store)
        if self.version == "v2" and self.use_harmonizer:
            acc.before_reduce(self.add_shared_harmonizer)
        return acc

    # -- the plan -------------------------------------------------------------------------------
    def is_calibration(self, round_idx: int) -> bool:
        return round_idx >= 1 and (round_idx - 1) % self.calibration_every == 0

    def plan(self, round_idx: int) -> RoundPlan:
        calibrate = self.is_calibration(round_idx)
        tasks = []
        for client in self.cohort(round_idx):
            index, r = self.choose(client, round_idx)
            tasks.append(ClientTask(client, cut=self.cuts[index], choice=CutChoice(index, calibrate, r)))
        return RoundPlan(round_idx, self.round_lr(round_idx), tasks)

    def choose(self, client: int, round_idx: int) -> tuple[int, Optional[float]]:
        """The client's candidate index this round and the sufficiency probability behind it."""
        from fl_lightning.modules.sufficiency import handcrafted_score, split_index

        deepest = self.afford[client] if self.afford is not None else len(self.cuts) - 1
        if self.split_strategy == "static":
            return min(self.static_index, deepest), None
        if self.split_strategy == "random":
            generator = torch.Generator().manual_seed(derive_seed(self.ctx.seed, SPLIT_STREAM, round_idx, client))
            return int(torch.randint(deepest + 1, (1,), generator=generator)), None
        state = self.store.get(client)
        if state["has_descriptor"].item() == 0 or (self.use_estimator and not self.estimator.trained.item()):
            return min(self.ref_index, deepest), None
        descriptor = state["descriptor"].cpu()
        r = self.estimator.probability(descriptor) if self.use_estimator else handcrafted_score(descriptor)
        return split_index(r, len(self.cuts), self.rho, deepest), r

    # -- a client's round -----------------------------------------------------------------------
    def probe(self, client: int):
        """The client's fixed probe batch (evaluation transform), on the device."""
        if client not in self._probes:
            from fl_lightning.runtime.client_data import eval_batches

            indices = self.ctx.data.clients[client]
            generator = torch.Generator().manual_seed(derive_seed(self.ctx.seed, PROBE_STREAM, client))
            chosen = indices[torch.randperm(len(indices), generator=generator)[:self._probe_count]]
            self._probes[client] = next(eval_batches(self.ctx.data.bundle.train_eval, chosen, len(chosen),
                                                     self.ctx.fabric.device))
        return self._probes[client]

    def load_server_harmonizer(self, task: ClientTask, plan: RoundPlan) -> None:
        """The harmonizer the server half trains with for this client: a copy of the global one
        per client (V1), or one carried through the round from its first client (shared). Marks
        this rank as one that trained the round's harmonizer (its tensors enter the round sums)."""
        if self.version == "v1" or task is plan.tasks[0]:
            self.harmonizer_worker.load_state_dict(self.harmonizer.state_dict())

    def downlink(self, task: ClientTask, plan: RoundPlan) -> Downlink:
        """The front the client receives, up to the deeper of its cut and p_ref (the received
        model's probe interfaces need it), its state from the store (its prompt, held), and on
        the server side its half and harmonizer loaded."""
        self.load_server_harmonizer(task, plan)
        deepest = self.cuts[max(task.choice.index, self.ref_index)]
        return Downlink(self.engine.receive(task, plan, deepest=deepest), held=self.store.get(task.client))

    def new_client(self, task: ClientTask, plan: RoundPlan) -> FedSGAClient:
        """The client's round (``algorithms/split/fedsga_client.py``) with its probe batch, on
        the server half's harmonizer for this client."""
        return FedSGAClient(self.client_round(task, plan), self.engine, self.probe(task.client), self.client_settings,
                            self.client_parts)

    def client_figures(self, task: ClientTask, result, plan: RoundPlan) -> Dict[str, float]:
        """The alignment descriptor, read by the server from the client's uploaded shallow
        interface with the p1 probe: how well it separates the client's classes as every
        client's shallow interfaces are read (in [0, 1])."""
        from fl_lightning.modules.harmonizer import standardized

        _, y = self.probe(task.client)
        return {"alignment": self.probes.true_class_probability(standardized(result.payload.shallow), y, 0)}

    def server_trainables(self) -> Dict[str, torch.Tensor]:
        if not self.use_harmonizer:
            return {}
        return {f"harmonizer.{k}": v for k, v in self.harmonizer_worker.named_parameters()}

    @property
    def blocks_alignment_from_prompt(self) -> bool:
        """``prompt_gradient: task`` with a prompt and an alignment term that reaches the model."""
        return self.adaptation_channel and self.use_harmonizer and self.prompt_gradient == "task"

    def commit(self, acc, task: ClientTask[CutChoice], result, plan: RoundPlan) -> None:
        """Besides the halves: the server copy's harmonizer (V1), the prototypes' class sums,
        the probe interfaces, the calibration's descriptor (the one the plan used) and the
        client's new store entry (its held state and the descriptor the server assembles from
        its alignment and the client's stability and prompt variation)."""
        super().commit(acc, task, result, plan)
        record = result.payload
        weight = float(result.num_samples)
        if record.harmonizer is not None:  # server copies: the projector is averaged
            for name, value in record.harmonizer.items():
                acc.add_sum(f"harmonizer/{name}", weight * value)
            acc.add_sum("harmonizer/weight", weight)
        acc.add_sum("prototypes/sums", record.class_sums)
        acc.add_sum("prototypes/counts", record.class_counts)
        for depth, rows in record.probe_rows.items():
            acc.add_sum(f"probe/rows{depth}", rows, at=task.client)
        acc.add_sum("probe/mask", 1.0, at=task.client)
        old = self.store.get(task.client)
        if task.choice.calibrate and old["has_descriptor"].item():
            flagged = torch.cat([old["descriptor"].double(), old["descriptor"].new_ones(1).double()])
            acc.add_sum("calibration/descriptors", flagged, at=task.client)
        figures = result.metrics
        descriptor = torch.tensor([figures["alignment"], figures["stability"], figures["prompt_variation"]],
                                  device=old["descriptor"].device)
        acc.keep("clients", task.client, {"prompt": result.held["prompt"], "descriptor": descriptor,
                                          "has_descriptor": torch.ones_like(old["has_descriptor"]),
                                          "probe_features": result.held["probe_features"]})

    # -- the server's round end -----------------------------------------------------------------
    def add_shared_harmonizer(self, acc) -> None:
        """The shared server's harmonizer, from the rank that trained it (weight 1)."""
        if acc.committed == 0:
            return
        for name, value in averaged_tensors(self.harmonizer_worker).items():
            acc.add_sum(f"harmonizer/{name}", value.detach().double())
        acc.add_sum("harmonizer/weight", 1.0)

    def finish_round(self, acc, plan) -> Dict[str, float]:
        figures = super().finish_round(acc, plan)
        h = self.harmonizer
        with torch.no_grad():
            weight = acc["harmonizer/weight"]
            if weight > 0:
                for name, value in averaged_tensors(h).items():
                    value.copy_((acc[f"harmonizer/{name}"] / weight).to(value.dtype))
        if self.use_harmonizer:
            h.update_prototypes(acc["prototypes/sums"].to(h.prototypes.device), acc["prototypes/counts"].to(h.prototypes.device))
        probe_fit = self.fit_probes(acc)
        if self.is_calibration(plan.round_idx):
            figures.update(self.calibrate(acc))
        cuts = [t.choice.index for t in plan.tasks]
        figures.update({"split/mean_index": sum(cuts) / len(cuts),
                        "split/frac_p1": sum(k == 0 for k in cuts) / len(cuts)})
        figures.update({f"split/frac_cut{k}": sum(c == k for c in cuts) / len(cuts) for k in range(len(self.cuts))})
        figures.update(probe_fit)
        return figures

    def probe_data(self, sums) -> tuple[List[int], Dict[int, torch.Tensor], torch.Tensor]:
        """The round's probe interfaces: the committed clients in index order (the same on every
        rank), each probed depth's rows ``[client, example, width]`` and the labels ``[client, example]``."""
        clients = [c for c in range(self.ctx.num_clients) if sums["probe/mask"][c] > 0]
        if not clients:
            return clients, {}, torch.zeros(0, 0, dtype=torch.long)
        labels = torch.stack([self.probe(c)[1] for c in clients])
        rows = {d: sums[f"probe/rows{d}"][clients].to(labels.device) for d in self.probed}
        return clients, rows, labels

    def fit_probes(self, sums) -> Dict[str, float]:
        """Refit every probed depth's probe on the first half of every committed client's probe
        batch, the interfaces of the model this round received."""
        clients, rows, labels = self.probe_data(sums)
        if not clients:
            return {}
        fit = self._fit_rows
        features = {d: r[:, :fit].flatten(0, 1) for d, r in rows.items()}
        return {f"probe/{k}": v for k, v in self.probes.fit(features, labels[:, :fit].flatten()).items()}

    def calibrate(self, sums) -> Dict[str, float]:
        """A calibration round's labels and Gamma's training: every client that had a descriptor
        is labelled ``L(p1) <= (1 + beta) L(p_ref)`` from the losses of the probes just refit on
        this round's interfaces, scored on its held-out probe examples, and the label pairs with
        the descriptor the round's plan used."""
        from fl_lightning.modules.sufficiency import held_out_losses, sufficiency_labels

        clients, rows, labels = self.probe_data(sums)
        flagged = sums["calibration/descriptors"]
        chosen = (flagged[clients, 3] > 0).nonzero().flatten().tolist()
        if not chosen:
            return {}
        held = slice(self._fit_rows, None) if labels.shape[1] > self._fit_rows else slice(None)
        losses = {d: held_out_losses(self.probes, d, rows[d][chosen][:, held], labels[chosen][:, held])
                  for d in (0, self.ref_index)}
        sufficient = sufficiency_labels(losses[0], losses[self.ref_index], self.beta).double().cpu()
        descriptors = flagged[[clients[k] for k in chosen], :3].double().cpu()
        self.pairs = torch.cat([self.pairs, torch.cat([descriptors, sufficient[:, None]], 1)])[-self.estimator_buffer:]
        figures = {"calibration/frac_sufficient": float(sufficient.mean()),
                   "calibration/probe_loss_p1": float(losses[0].mean()),
                   "calibration/probe_loss_ref": float(losses[self.ref_index].mean())}
        if self.use_estimator and self.split_strategy == "sufficiency":
            fit = self.estimator.fit(self.pairs[:, :3], self.pairs[:, 3])
            figures.update({f"estimator/{k}": v for k, v in fit.items()})
        return figures

    # -- evaluation -----------------------------------------------------------------------------
    @property
    def served_names(self) -> Dict[str, str]:
        """With an additive read-out, each candidate cut's served accuracy (``acc_cut<k>``) named
        by its cut and client-side MACs."""
        from fl_lightning.units import macs

        if not self.harmonized:
            return {}
        return {f"acc_cut{k}": f"cut{k} {cut} {macs(self.halves.front_macs[cut])}" for k, cut in enumerate(self.cuts)}

    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        """The served model: with the harmonized prediction, the model cut at ``eval_cut``
        (default p_ref) with the harmonizer's head; every candidate's accuracy as ``acc_cut<k>``."""
        if not self.harmonized:
            return super().evaluate(split, batch_size)
        from fl_lightning.modules.harmonizer import HarmonizedNetwork
        from fl_lightning.runtime.evaluation import evaluate

        data = self.ctx.data
        model = self.statistics.served(self.ctx.model)
        dataset, indices = data.split(split)
        out = {}
        for depth, cut in enumerate(self.cuts):
            served = HarmonizedNetwork(model, self.harmonizer, cut, depth).train(model.training)
            metrics = evaluate(self.ctx.fabric, served, dataset, indices, data.bundle.num_classes, batch_size)
            if depth == self.eval_index:
                out.update(metrics)
            if "acc" in metrics:
                out[f"acc_cut{depth}"] = metrics["acc"]
        return out
