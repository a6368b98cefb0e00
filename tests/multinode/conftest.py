import pytest

from tests.multinode.nodes import NodeSet


@pytest.fixture(scope="module")
def nodes():
    """node0, node1, node2 (tests/multinode/nodes.py); skipped with the reason where they cannot be built."""
    why = NodeSet.refusal()
    if why:
        pytest.skip(why)
    with NodeSet(3) as ns:
        ns.wait_reachable(ns[1], ns[0], 9)
        yield ns
