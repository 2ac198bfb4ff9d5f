"""A FedSGA client's round: the calibration probes on the received model (calibration rounds),
its prompt, the server's loss with the alignment term, and the descriptors it reports after
training (docs/fedsga.md).

The method (``algorithms/split/fedsga.py``) makes one :class:`FedSGAClient` per task from the
client's store entry; the object carries everything the round learns about that client (its
prompt and the prompt's gradient statistics, the alignment term of the batch in flight, the
labels it added to the prototypes) and hands the server its new store entry in a
:class:`NextClientState`, which the method applies when the result is committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

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


@dataclass
class NextClientState:
    """What a FedSGA client fit hands the server, applied when the result is committed (a
    non-finite result leaves the store as it was)."""

    store: Dict[str, torch.Tensor]
    """The client's new store entry: prompt, descriptor, its flag and the probe features."""
    old_descriptor: torch.Tensor
    """The descriptor the round's plan used, paired with this round's calibration label."""
    had_descriptor: bool
    sufficient: Optional[float]
    """The calibration label of this round (None outside calibration rounds)."""
    class_sums: torch.Tensor
    """Per class, the sum of the projected features of this client's examples (the round's prototype statistics)."""
    class_counts: torch.Tensor
    """Examples of each class the server saw from this client."""
    probe_rows: Dict[int, torch.Tensor]
    """The received model's standardized pooled probe interfaces at each probed depth (the probes' training data)."""


class FedSGAClient(SplitClient):
    """One FedSGA client's round on the method's workers (``method``: the :class:`FedSGA`)."""

    def __init__(self, method, task: ClientTask, plan: RoundPlan, state: Dict[str, torch.Tensor]):
        super().__init__(method, task, plan)
        self.state = state
        self.depth = task.choice.index
        self.prompt_before = state["prompt"].detach().clone()
        self.prompt = state["prompt"].detach().clone().requires_grad_(method.adaptation_channel)
        self.grad_norms = torch.zeros(method.num_prompts, dtype=torch.float64)
        self.grad_steps = 0
        prototypes = method.harmonizer.prototypes
        self.class_sums = torch.zeros(prototypes.shape, dtype=torch.float64, device=prototypes.device)
        self.class_counts = torch.zeros(prototypes.shape[0], dtype=torch.float64, device=prototypes.device)
        self.align_term: Optional[torch.Tensor] = None  # the batch in flight's alignment loss
        self.align_grad: Optional[torch.Tensor] = None  # its gradient at the cut (prompt_gradient: task)

    def fit(self):
        """The received model's probe interfaces (and in calibration rounds the probe losses),
        the split round, then the descriptors; the client's next store entry waits in the
        result's payload."""
        from fl_lightning.modules.sufficiency import sufficiency_label

        method, task = self.method, self.task
        method.load_server_harmonizer(task, self.plan)
        probe_link = Channel()
        self.probe_rows = method.probe_interfaces(task.client, self.prompt.detach(), probe_link)
        calibration = {}
        if task.choice.calibrate:
            _, y = method.probe(task.client)
            loss_p1 = method.probes.loss(self.probe_rows[0], y, 0)
            loss_ref = method.probes.loss(self.probe_rows[method.ref_index], y, method.ref_index)
            calibration = {"probe_loss_p1": loss_p1, "probe_loss_ref": loss_ref,
                           "sufficient": float(sufficiency_label(loss_p1, loss_ref, method.beta))}
        result = method.fit_split_client(self)
        result.channel.merge(probe_link)
        result.metrics.update(calibration)
        figures, result.payload = self.report(calibration, result.channel)
        result.metrics.update(figures)
        return result

    # -- the client half ------------------------------------------------------------------------
    def forward(self, front):
        return self.method.prompted(front, self.prompt)

    def trainables(self):
        return [self.prompt] if self.method.adaptation_channel else []

    def after_backward(self) -> None:
        """The prompt's per-token gradient norms, for the prompt-state variation descriptor."""
        if self.method.adaptation_channel and self.prompt.grad is not None:
            self.grad_norms += self.method.prompts.token_norms(self.prompt.grad.detach()).double().cpu()
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
        method = self.method
        logits = back(sent)
        if not method.use_harmonizer:
            return F.cross_entropy(logits, y)
        harmonizer = method.harmonizer_worker
        features = harmonizer.project(sent, self.depth)
        if method.harmonized:
            logits = logits + harmonizer.head(features).to(logits.dtype)
        sums, counts = harmonizer.class_sums(features, y)
        self.class_sums += sums
        self.class_counts += counts
        align = method.lambda_align * harmonizer.alignment_loss(features, y)
        self.align_term = align
        return F.cross_entropy(logits, y) + align

    def server_rule(self, fabric, pair, sent, y, cfg, index, fit) -> tuple:
        """One server step; with the prompt kept from the alignment term, that term's gradient at
        the cut is sent down too, beside the total (``backward`` uses it)."""
        with fabric.autocast():
            loss = pair.server_loss(sent, y)
        if self.method.blocks_alignment_from_prompt and self.align_term is not None:
            self.align_grad, = torch.autograd.grad(self.align_term, sent, retain_graph=True)
            fit.channel.down("align", self.align_grad)
        self.align_term = None
        fabric.backward(loss)
        pair.clip_server(fabric, cfg)
        pair.server_optimizer.step()
        return loss.detach(), sent.grad

    # -- after training -------------------------------------------------------------------------
    @torch.no_grad()
    def report(self, calibration: dict, channel: Channel) -> Tuple[Dict[str, float], NextClientState]:
        """Descriptors on the probe batch with the trained front and prompt (batch norm on the
        probe batch's statistics, as the interface is computed in training; the client uploads
        its shallow interface): the round's figures and the client's next store
        entry."""
        from fl_lightning.elastic.bn import batch_statistics
        from fl_lightning.modules.harmonizer import pool_interface, standardized
        from fl_lightning.modules.sufficiency import prompt_variation, temporal_stability

        method, state = self.method, self.state
        prompt = self.prompt.detach()
        x, y = method.probe(self.task.client)
        with batch_statistics(method.client_worker):
            front, _ = method.client_worker.split(method.cuts[0])
            with method.ctx.fabric.autocast():
                shallow = method.prompted(front, prompt)(x)
        channel.up("probe", shallow)  # the labels went up with the round's probe interfaces
        pooled = pool_interface(shallow).float()
        alignment = method.probes.true_class_probability(standardized(shallow), y, 0)
        previous = state["probe_features"] if state["has_descriptor"].item() else None
        stability = temporal_stability(pooled, previous)
        if method.adaptation_channel and self.grad_steps:
            variation = prompt_variation(method.prompts.tokens(self.prompt_before), method.prompts.tokens(prompt),
                                         self.grad_norms / self.grad_steps, method.tau_m)
        else:
            variation = 0.0
        descriptor = torch.tensor([alignment, stability, variation], device=state["descriptor"].device)
        payload = NextClientState(
            store={"prompt": prompt.clone(), "descriptor": descriptor,
                   "has_descriptor": torch.ones_like(state["has_descriptor"]),
                   "probe_features": pooled.to(state["probe_features"])},
            old_descriptor=state["descriptor"].clone(), had_descriptor=bool(state["has_descriptor"].item()),
            sufficient=calibration.get("sufficient"), class_sums=self.class_sums, class_counts=self.class_counts,
            probe_rows=self.probe_rows)
        figures = {"cut": self.depth, "alignment": alignment, "stability": stability,
                   "prompt_variation": variation, "prompt_norm": float(prompt.norm())}
        if self.task.choice.r is not None:
            figures["r"] = self.task.choice.r
        return figures, payload
