"""Partial rollouts: a step trains on the groups that finished first; the others stay in flight.
`pool`: the pool of groups, their admission, the earliest-deadline pick and the stream that cuts the
engine where the step can pick; `agents`: the same for agent episodes (imported on its own: it brings
the agent endpoint's HTTP stack)."""

from .pool import InFlight, PartialLimits, PartialRollouts

__all__ = ["InFlight", "PartialLimits", "PartialRollouts"]
