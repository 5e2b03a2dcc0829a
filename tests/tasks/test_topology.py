"""Client-to-edge topology: contiguous, balanced blocks of partition ids."""

import pytest

from tasks.topology import edge_members, edge_of


@pytest.mark.parametrize(
    ("num_partitions", "num_edges", "expected"),
    [(10, 2, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
     # floor(e * 7 / 3) = 0, 2, 4, 7
     (7, 3, [[0, 1], [2, 3], [4, 5, 6]]),
     (5, 5, [[0], [1], [2], [3], [4]]),
     (4, 1, [[0, 1, 2, 3]]),
     # floor(e * 10 / 4) = 0, 2, 5, 7, 10
     (10, 4, [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]])],
)  # fmt: skip
def test_edge_members_by_hand(num_partitions, num_edges, expected):
    assert edge_members(num_partitions, num_edges) == expected


@pytest.mark.parametrize("num_partitions", [1, 2, 7, 10, 23, 100])
def test_every_partition_in_exactly_one_edge_and_sizes_balanced(num_partitions):
    for num_edges in range(1, num_partitions + 1):
        # Execute
        members = edge_members(num_partitions, num_edges)
        owners = [edge_of(p, num_partitions, num_edges) for p in range(num_partitions)]

        # Assert
        flat = [p for block in members for p in block]
        assert flat == list(range(num_partitions))
        sizes = [len(block) for block in members]
        assert len(sizes) == num_edges
        assert max(sizes) - min(sizes) <= 1
        assert all(owners[p] == e for e, block in enumerate(members) for p in block)


@pytest.mark.parametrize(("num_partitions", "num_edges"), [(5, 0), (5, 6), (3, -1)])
def test_num_edges_out_of_range_names_key_and_range(num_partitions, num_edges):
    with pytest.raises(ValueError, match=r"hier\.num-edges.*\[1, " + str(num_partitions)):
        edge_members(num_partitions, num_edges)
    with pytest.raises(ValueError, match=r"hier\.num-edges"):
        edge_of(0, num_partitions, num_edges)


def test_non_integer_num_edges_raises():
    with pytest.raises(ValueError, match=r"hier\.num-edges.*integer"):
        edge_members(4, 2.0)


@pytest.mark.parametrize("partition_id", [-1, 4])
def test_partition_id_out_of_range_raises(partition_id):
    with pytest.raises(ValueError, match="partition_id"):
        edge_of(partition_id, 4, 2)
