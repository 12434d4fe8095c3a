"""dist.peer_lost: a collective failure (a peer gone) told from this rank's own error."""

import torch

from verl_ds.dist import lost_peer_line, peer_lost


def test_peer_lost_tells_a_collective_failure_from_this_ranks_own_error():
    """What `cli.main` turns into the one 'rank N is gone' line, and what keeps its traceback."""
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:439. "
        "This is typically caused by a remote worker crashing."
    )
    assert peer_lost(gloo)
    assert peer_lost(torch.distributed.DistNetworkError("Broken pipe"))
    try:  # raised while handling it, as a role's error handler might
        try:
            raise gloo
        except RuntimeError:
            raise ValueError("while saving") from None
    except ValueError as e:
        assert not peer_lost(e)  # `from None`: not caused by it
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = gloo
    assert peer_lost(wrapped)
    assert not peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not peer_lost(KeyError("actor/pg_loss"))
    assert lost_peer_line(KeyError("x")) is None
