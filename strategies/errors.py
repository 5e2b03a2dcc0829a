"""The exceptions strategies raise to end a run (``InvalidReply``, about a message's
content, is the contract's: :mod:`protocol.records`)."""


class StopTraining(Exception):
    """Raised by ``configure_train`` to end the run before sending anything: the run
    cannot go on (too few nodes, a setting that cannot be met), ``outcome.json``
    status ``failed``."""


class BudgetExhausted(StopTraining):
    """The next round would exceed the privacy budget: the run ends as planned, with
    what it released so far (``outcome.json`` status ``stopped``)."""


class DuplicatePartitionError(StopTraining):
    """Two connected nodes report the same partition id: one unit of privacy (and one
    client's data) would be sampled, and counted, twice. The run stops before the round."""
