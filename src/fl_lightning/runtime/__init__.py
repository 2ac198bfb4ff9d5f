"""What the round loop and the algorithms share, so that neither imports the other.

The loop asks an algorithm for a :class:`RoundPlan`, runs each :class:`ClientTask` through the
client object the algorithm makes for it (``algorithm.new_client(task, plan).fit()``), and gets
back a :class:`ClientResult`; the algorithm sees the run through a :class:`RunContext`.
"""

from fl_lightning.runtime.context import RunContext
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.result import ClientResult

__all__ = ["RunContext", "ClientTask", "RoundPlan", "ClientResult"]
