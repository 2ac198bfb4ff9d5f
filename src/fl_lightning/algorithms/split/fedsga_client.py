"""A FedSGA client's round: the received model's probe interfaces (the server fits the depth
probes and labels calibration rounds from them), its prompt, the server's loss with the alignment
term, and the descriptors it reports after training (docs/fedsga.md).

The method (``algorithms/split/fedsga.py``) makes one :class:`FedSGAClient` per task from the
client's store entry; the object carries everything the round learns about that client (its
prompt and the prompt's gradient statistics, the alignment term of the batch in flight, the
labels it added to the prototypes) and hands the server its new store entry in a
:class:`NextClientState`, which the method applies when the result is committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms.split.common import SplitClient
from fl_lightning.runtime.channel import Channel
from fl_lightning.runtime.plan import ClientTask, RoundPlan


@dataclass(frozen=True)
class CutChoice:
    """What the server chose for a FedSGA client: its candidate cut index, whether the round calibrates,
    and the sufficiency probability behind the choice (None for the static and random strategies)."""

    index: int
    calibrate: bool
    r: Optional[float] = None


@dataclass(frozen=True)
class FedSGASettings:
    """The FedSGA options a client's round reads (the method's, fixed for the run)."""

    adaptation_channel: bool
    """The client trains private prompt tokens."""
    use_harmonizer: bool
    harmonized: bool
    """An additive read-out of the harmonized interface is on the server's prediction path."""
    lambda_align: float
    blocks_alignment_from_prompt: bool
    """``prompt_gradient: task``: the alignment term's gradient is kept from the prompt."""
    tau_m: float
    """Prompt contribution temperature."""
    ref_index: int
    num_prompts: int


@dataclass(frozen=True)
class FedSGAParts:
    """The rank's parts a FedSGA client's round works with: the received global model and the
    candidate cuts, the prompt channel, the server half's harmonizer, the depth probes and the
    worker the client's front trains in."""

    model: nn.Module
    cuts: List[str]
    probed: List[int]
    """The depths the calibration and the alignment descriptor read."""
    prompts: Any
    harmonizer: nn.Module
    probes: nn.Module
    client_worker: nn.Module


@dataclass
class NextClientState:
    """What a FedSGA client fit hands the server, applied when the result is committed (a
    non-finite result leaves the store as it was)."""

    store: Dict[str, torch.Tensor]
    """The client's new store entry: prompt, descriptor, its flag and the probe features."""
    old_descriptor: torch.Tensor
    """The descriptor the round's plan used, paired with this round's calibration label."""
    had_descriptor: bool
    class_sums: torch.Tensor
    """Per class, the sum of the projected features of this client's examples (the round's prototype statistics)."""
    class_counts: torch.Tensor
    """Examples of each class the server saw from this client."""
    probe_rows: Dict[int, torch.Tensor]
    """The received model's standardized pooled probe interfaces at each probed depth (what the
    server fits the probes on and labels the calibration from)."""


class FedSGAClient(SplitClient):
    """One FedSGA client's round on the rank's split engine and parts: given its store entry
    ``state``, its probe batch, the method's settings and the parts (``FedSGAParts``)."""

    def __init__(self, method, task: ClientTask, plan: RoundPlan, engine, state: Dict[str, torch.Tensor],
                 probe: Tuple[torch.Tensor, torch.Tensor], settings: FedSGASettings, parts: FedSGAParts):
        super().__init__(method, task, plan, engine)
        self.state, self.probe, self.settings, self.parts = state, probe, settings, parts
        self.depth = task.choice.index
        self.prompt_before = state["prompt"].detach().clone()
        self.prompt = state["prompt"].detach().clone().requires_grad_(settings.adaptation_channel)
        self.grad_norms = torch.zeros(settings.num_prompts, dtype=torch.float64)
        self.grad_steps = 0
        prototypes = parts.harmonizer.prototypes
        self.class_sums = torch.zeros(prototypes.shape, dtype=torch.float64, device=prototypes.device)
        self.class_counts = torch.zeros(prototypes.shape[0], dtype=torch.float64, device=prototypes.device)
        self.align_term: Optional[torch.Tensor] = None  # the batch in flight's alignment loss
        self.align_grad: Optional[torch.Tensor] = None  # its gradient at the cut (prompt_gradient: task)

    def fit(self):
        """The received model's probe interfaces, the split round, then the descriptors; the
        client's next store entry waits in the result's payload."""
        probe_link = Channel()
        self.probe_rows = self.received_interfaces(probe_link)
        result = self.engine.run(self)
        result.channel.merge(probe_link)
        figures, result.payload = self.report(result.channel)
        result.metrics.update(figures)
        return result

    @torch.no_grad()
    def received_interfaces(self, channel: Channel) -> Dict[int, torch.Tensor]:
        """The received model's interfaces at the probed depths (p1 and p_ref) on the client's
        probe batch, standardized and pooled as the probes read them; what the client uploads for
        them (the interfaces and the labels) crosses ``channel``.

        The network computes the same prediction wherever it is cut, so the probe is not the
        task loss: it is a linear classifier per depth (``DepthProbes``), i.e. how well the
        interface at that depth already separates the classes (docs/fedsga.md). The interfaces
        are computed as training computes them, batch norm on the probe batch's own statistics
        (running statistics untouched).
        """
        from fl_lightning.elastic.bn import batch_statistics
        from fl_lightning.modules.harmonizer import standardized

        parts, prompt = self.parts, self.prompt.detach()
        x, y = self.probe
        out = {}
        channel.up("probe", y)
        with batch_statistics(parts.model):
            for depth in parts.probed:
                front, _ = parts.model.split(parts.cuts[depth])
                with self.round.fabric.autocast():
                    interface = self.prompted(front, prompt)(x)
                channel.up("probe", interface)
                out[depth] = standardized(interface)
        return out

    # -- the client half ------------------------------------------------------------------------
    def prompted(self, front, prompt):
        """``front`` with ``prompt`` applied to its input (as it is without the adaptation channel)."""
        return self.parts.prompts.apply(front, prompt) if self.settings.adaptation_channel else front

    def forward(self, front):
        return self.prompted(front, self.prompt)

    def trainables(self):
        return [self.prompt] if self.settings.adaptation_channel else []

    def after_backward(self) -> None:
        """The prompt's per-token gradient norms, for the prompt-state variation descriptor."""
        if self.settings.adaptation_channel and self.prompt.grad is not None:
            self.grad_norms += self.parts.prompts.token_norms(self.prompt.grad.detach()).double().cpu()
            self.grad_steps += 1

    def backward(self, fabric, z: torch.Tensor, grad: torch.Tensor) -> None:
        """With ``prompt_gradient: task`` the server sent the alignment term's gradient at the cut
        beside the total, and the prompt's gradient leaves that part out."""
        align, self.align_grad = self.align_grad, None
        if align is None:
            fabric.backward(z, grad)
            return
        prompt_align, = torch.autograd.grad(z, self.prompt, align, retain_graph=True)
        fabric.backward(z, grad)
        self.prompt.grad -= prompt_align

    # -- the server's side of the client's batches ----------------------------------------------
    def server_loss(self, back, sent, y):
        """CE of the server's prediction (with the harmonized read-out on its path) plus
        lambda times the alignment loss against the prototypes of the previous rounds; the
        batch's projected features add to the round's prototype statistics. Without
        harmonization, plain cross-entropy."""
        settings = self.settings
        logits = back(sent)
        if not settings.use_harmonizer:
            return F.cross_entropy(logits, y)
        harmonizer = self.parts.harmonizer
        features = harmonizer.project(sent, self.depth)
        if settings.harmonized:
            logits = logits + harmonizer.head(features).to(logits.dtype)
        sums, counts = harmonizer.class_sums(features, y)
        self.class_sums += sums
        self.class_counts += counts
        align = settings.lambda_align * harmonizer.alignment_loss(features, y)
        self.align_term = align
        return F.cross_entropy(logits, y) + align

    def server_rule(self, fabric, pair, sent, y, cfg, index, fit) -> tuple:
        """One server step; with the prompt kept from the alignment term, that term's gradient at
        the cut is sent down too, beside the total (``backward`` uses it)."""
        with fabric.autocast():
            loss = pair.server_loss(sent, y)
        if self.settings.blocks_alignment_from_prompt and self.align_term is not None:
            self.align_grad, = torch.autograd.grad(self.align_term, sent, retain_graph=True)
            fit.channel.down("align", self.align_grad)
        self.align_term = None
        fabric.backward(loss)
        pair.clip_server(fabric, cfg)
        pair.server_optimizer.step()
        return loss.detach(), sent.grad

    # -- after training -------------------------------------------------------------------------
    @torch.no_grad()
    def report(self, channel: Channel) -> Tuple[Dict[str, float], NextClientState]:
        """Descriptors on the probe batch with the trained front and prompt (batch norm on the
        probe batch's statistics, as the interface is computed in training; the client uploads
        its shallow interface): the round's figures and the client's next store
        entry."""
        from fl_lightning.elastic.bn import batch_statistics
        from fl_lightning.modules.harmonizer import pool_interface, standardized
        from fl_lightning.modules.sufficiency import prompt_variation, temporal_stability

        settings, parts, state = self.settings, self.parts, self.state
        prompt = self.prompt.detach()
        x, y = self.probe
        with batch_statistics(parts.client_worker):
            front, _ = parts.client_worker.split(parts.cuts[0])
            with self.round.fabric.autocast():
                shallow = self.prompted(front, prompt)(x)
        channel.up("probe", shallow)  # the labels went up with the round's probe interfaces
        pooled = pool_interface(shallow).float()
        alignment = parts.probes.true_class_probability(standardized(shallow), y, 0)
        previous = state["probe_features"] if state["has_descriptor"].item() else None
        stability = temporal_stability(pooled, previous)
        if settings.adaptation_channel and self.grad_steps:
            variation = prompt_variation(parts.prompts.tokens(self.prompt_before), parts.prompts.tokens(prompt),
                                         self.grad_norms / self.grad_steps, settings.tau_m)
        else:
            variation = 0.0
        descriptor = torch.tensor([alignment, stability, variation], device=state["descriptor"].device)
        payload = NextClientState(
            store={"prompt": prompt.clone(), "descriptor": descriptor,
                   "has_descriptor": torch.ones_like(state["has_descriptor"]),
                   "probe_features": pooled.to(state["probe_features"])},
            old_descriptor=state["descriptor"].clone(), had_descriptor=bool(state["has_descriptor"].item()),
            class_sums=self.class_sums, class_counts=self.class_counts, probe_rows=self.probe_rows)
        figures = {"cut": self.depth, "alignment": alignment, "stability": stability,
                   "prompt_variation": variation, "prompt_norm": float(prompt.norm())}
        if self.task.choice.r is not None:
            figures["r"] = self.task.choice.r
        return figures, payload
