"""What the round loop and the algorithms share, so that neither imports the other.

The loop asks an algorithm for a :class:`RoundPlan` and for this rank's share of it
(``fit_cohort``), each :class:`ClientTask` giving a :class:`Downlink` down and an :class:`Uplink`
back; the algorithm sees the run through a :class:`RunContext`.
"""

from fl_lightning.runtime.context import RunContext
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.link import Downlink, Uplink

__all__ = ["RunContext", "ClientTask", "RoundPlan", "Downlink", "Uplink"]
