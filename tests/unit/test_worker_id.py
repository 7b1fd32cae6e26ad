"""recycle.ir.Worker: one text form, read back exactly, and a tuple wherever (replica, stage) pairs are held."""

from __future__ import annotations

import pytest

from recycle.ir import Worker, workers_text


def test_text_form_round_trips() -> None:
    assert str(Worker(1, 2)) == "1:2"
    assert f"worker {Worker(10, 0)}" == "worker 10:0"
    assert Worker.parse(" 3 : 4 ") == Worker(3, 4)
    assert Worker.parse(str(Worker(7, 5))) == (7, 5)


def test_it_is_the_pair_plans_hold() -> None:
    assert Worker(1, 2) == (1, 2) and hash(Worker(1, 2)) == hash((1, 2))
    assert Worker(1, 2) in frozenset({(1, 2)})
    assert repr(Worker(1, 2)) == "Worker(replica=1, stage=2)"


@pytest.mark.parametrize("text", ["", "1", "1:", ":2", "1:2:3", "a:1", "-1:0", "1.5:2"])
def test_malformed_text_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="REPLICA:STAGE"):
        Worker.parse(text)


def test_workers_text_sorts_and_joins() -> None:
    assert workers_text({(1, 1), (0, 3)}) == "0:3 1:1"
    assert workers_text([(2, 0), (0, 1)], ";") == "0:1;2:0"
    assert workers_text([]) == ""


def test_a_long_list_of_workers_names_the_first_and_counts_the_rest() -> None:
    many = [(replica, 0) for replica in range(2048)]
    assert workers_text(many, ", ", most=3) == "0:0, 1:0, 2:0, ... (2048 in all)"
    assert workers_text(many[:3], ", ", most=3) == "0:0, 1:0, 2:0"
