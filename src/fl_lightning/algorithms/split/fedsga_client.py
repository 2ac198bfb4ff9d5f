"""A FedSGA client's round: the received model's probe interfaces (the server fits the depth
probes and labels calibration rounds from them), its prompt, the server's loss with the alignment
term, and what it reports after training for the descriptors (docs/fedsga.md).

The method (``algorithms/split/fedsga.py``) makes one :class:`FedSGAClient` per task; the client
reads its own state (its prompt and last probe features) from its downlink's ``held`` and
returns the new one in its uplink's. The object carries everything the round learns about that
client (its prompt and the prompt's gradient statistics, the alignment term of the batch in
flight, the labels the server half added to the prototypes); what the server half learned and
what the client uploaded for the server's descriptors travel in a :class:`ServerRecord`, which
the method applies when the uplink is committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms.split.common import SplitClient
from fl_lightning.runtime.link import Downlink, Uplink


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
    copied_harmonizer: bool
    """The server half trains a copy of the harmonizer for this client (V1): its tensors go to
    the method's record, to be averaged."""


@dataclass(frozen=True)
class FedSGAParts:
    """The rank's parts a FedSGA client's round works with: the candidate cuts, the prompt
    channel and the server half's harmonizer (a worker loaded for the client's round)."""

    cuts: List[str]
    probed: List[int]
    """The depths the calibration and the alignment descriptor read."""
    prompts: Any
    harmonizer: nn.Module


@dataclass
class ServerRecord:
    """What the server side of a FedSGA client's round hands the method, applied when the
    uplink is committed (a non-finite uplink leaves everything as it was)."""

    shallow: torch.Tensor
    """The client's shallow interface on its probe batch after training (uploaded: the server
    reads the alignment descriptor from it)."""
    class_sums: torch.Tensor
    """Per class, the sum of the projected features of this client's examples (the round's prototype statistics)."""
    class_counts: torch.Tensor
    """Examples of each class the server saw from this client."""
    probe_rows: Dict[int, torch.Tensor]
    """The received model's standardized pooled probe interfaces at each probed depth (what the
    server fits the probes on and labels the calibration from)."""
    harmonizer: Optional[Dict[str, torch.Tensor]] = None
    """V1: the harmonizer copy the server half trained for this client (float64), averaged."""


class FedSGAClient(SplitClient):
    """One FedSGA client's round on the rank's split engine and parts: given its probe batch
    (a fixed draw of its own examples), the method's settings and the parts (``FedSGAParts``);
    its state comes with its downlink."""

    def __init__(self, round, engine, probe: Tuple[torch.Tensor, torch.Tensor], settings: FedSGASettings,
                 parts: FedSGAParts):
        super().__init__(round, engine)
        self.probe, self.settings, self.parts = probe, settings, parts
        self.depth = round.task.choice.index
        self.grad_norms = torch.zeros(settings.num_prompts, dtype=torch.float64)
        self.grad_steps = 0
        prototypes = parts.harmonizer.prototypes
        self.class_sums = torch.zeros(prototypes.shape, dtype=torch.float64, device=prototypes.device)
        self.class_counts = torch.zeros(prototypes.shape[0], dtype=torch.float64, device=prototypes.device)
        self.align_term: Optional[torch.Tensor] = None  # the batch in flight's alignment loss
        self.align_grad: Optional[torch.Tensor] = None  # its gradient at the cut (prompt_gradient: task)

    def fit(self, downlink: Downlink) -> Uplink:
        """The received model's probe interfaces, the split round, then what the descriptors
        read; the client's new own state goes in the uplink's ``held``, the server's record in its
        payload."""
        self.begin(downlink)
        self.probe_rows = self.received_interfaces(downlink)
        uplink = self.engine.run(self, downlink)
        figures, uplink.held, uplink.payload = self.report(downlink)
        uplink.metrics.update(figures)
        return uplink

    def begin(self, downlink: Downlink) -> None:
        """The client's state as its round starts: its store entry and its prompt (trainable
        with the adaptation channel)."""
        self.state = downlink.held
        self.prompt_before = self.state["prompt"].detach().clone()
        self.prompt = self.state["prompt"].detach().clone().requires_grad_(self.settings.adaptation_channel)

    @torch.no_grad()
    def received_interfaces(self, downlink: Downlink) -> Dict[int, torch.Tensor]:
        """The received model's interfaces at the probed depths (p1 and p_ref) on the client's
        probe batch, standardized and pooled as the probes read them; what the client uploads for
        them (the interfaces and the labels) crosses its channel. The client receives the front
        up to the deepest probed depth for them (``FedSGA.downlink``).

        The network computes the same prediction wherever it is cut, so the probe is not the
        task loss: it is a linear classifier per depth (``DepthProbes``), i.e. how well the
        interface at that depth already separates the classes (docs/fedsga.md). The interfaces
        are computed as training computes them, batch norm on the probe batch's own statistics
        (running statistics untouched).
        """
        from fl_lightning.elastic.bn import batch_statistics
        from fl_lightning.modules.harmonizer import standardized

        parts, prompt, model, channel = self.parts, self.prompt.detach(), downlink.model.module, downlink.channel
        x, y = self.probe
        out = {}
        channel.up("probe", y)
        with batch_statistics(model):
            for depth in parts.probed:
                front, _ = model.split(parts.cuts[depth])
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
    def report(self, downlink: Downlink) -> Tuple[Dict[str, float], Dict[str, torch.Tensor], ServerRecord]:
        """After training, on the probe batch with the trained front and prompt (batch norm on
        the probe batch's statistics, as the interface is computed in training): the client's
        own descriptors (temporal stability of its shallow interface, its prompt's variation),
        its shallow interface uploaded for the server's alignment descriptor, its new own state
        (prompt, pooled probe features) and the server's record."""
        from fl_lightning.elastic.bn import batch_statistics
        from fl_lightning.modules.harmonizer import pool_interface
        from fl_lightning.modules.sufficiency import prompt_variation, temporal_stability

        settings, parts, state = self.settings, self.parts, self.state
        prompt, worker = self.prompt.detach(), downlink.model.module
        x, _ = self.probe
        with batch_statistics(worker):
            front, _ = worker.split(parts.cuts[0])
            with self.round.fabric.autocast():
                shallow = self.prompted(front, prompt)(x)
        downlink.channel.up("probe", shallow)  # the labels went up with the round's probe interfaces
        pooled = pool_interface(shallow).float()
        previous = state["probe_features"] if state["has_descriptor"].item() else None
        stability = temporal_stability(pooled, previous)
        if settings.adaptation_channel and self.grad_steps:
            variation = prompt_variation(parts.prompts.tokens(self.prompt_before), parts.prompts.tokens(prompt),
                                         self.grad_norms / self.grad_steps, settings.tau_m)
        else:
            variation = 0.0
        held = {"prompt": prompt.clone(), "probe_features": pooled.to(state["probe_features"])}
        record = ServerRecord(shallow=shallow.detach(), class_sums=self.class_sums, class_counts=self.class_counts,
                              probe_rows=self.probe_rows)
        if settings.copied_harmonizer:
            from fl_lightning.modules.harmonizer import averaged_tensors

            record.harmonizer = {k: v.detach().double() for k, v in averaged_tensors(parts.harmonizer).items()}
        figures = {"cut": self.depth, "stability": stability, "prompt_variation": variation,
                   "prompt_norm": float(prompt.norm())}
        if self.task.choice.r is not None:
            figures["r"] = self.task.choice.r
        return figures, held, record
