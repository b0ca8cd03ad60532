"""One convention for the target states a draft reads (loading/target_states.py): transformers'
`hidden_states` indices, checked in one place against the states each reader can read."""

from __future__ import annotations

import pytest

from specdec_cli.errors import SpecdecError
from specdec_cli.loading.target_states import check_states, from_outputs

L = 4  # target layers: hidden states 0 .. 4, 4 after the final norm

# each reader's limits: specdec's feature drafts read any state, and -1 for the last; an EAGLE-3
# checkpoint 3 distinct ones up to L - 1 (no engine captures state L); specdec's EAGLE-3 export 3
# among 1 .. L - 1 (so both engines' counts hold them); DFlash, layer outputs, the states 1 .. L
READERS = {
    "feature": {"last": True},
    "eagle3 load": {"highest": L - 1, "count": 3},
    "eagle3 export": {"lowest": 1, "highest": L - 1, "count": 3},
    "dflash": {"lowest": 1},
}
CASES = [  # (states, the readers that take them)
    ((0, L), {"feature"}),
    ((-1,), {"feature"}),
    ((0, -1), {"feature"}),
    ((-2,), set()),
    ((0, 1, 3), {"feature", "eagle3 load"}),
    ((1, 2, 3), {"feature", "eagle3 load", "eagle3 export", "dflash"}),
    ((1, 2, L), {"feature", "dflash"}),
    ((1, 1, 2), {"feature", "dflash"}),
    ((L + 1,), set()),
    ((), set()),
    ((True,), set()),  # a JSON `true` is no layer
]


@pytest.mark.parametrize("states, readers", CASES, ids=[str(list(s)) for s, _ in CASES])
def test_each_reader_takes_its_states_and_refuses_the_rest_in_one_line(states, readers):
    for reader, limits in READERS.items():
        if reader in readers:
            assert check_states(states, L, "ids", **limits) == states
        else:
            with pytest.raises(SpecdecError) as refused:
                check_states(states, L, f"{reader} ids {list(states)}", **limits)
            message = str(refused.value)
            assert "\n" not in message and message.startswith(f"{reader} ids {list(states)} do not fit a target of 4")


def test_layer_outputs_are_the_inputs_of_the_next_layer():
    # SpecForge's EAGLE-3 ids and z-lab's DFlash ids count outputs: output of layer i = hidden_states[i + 1]
    assert from_outputs([0, 1, L - 1]) == [1, 2, L]
    assert from_outputs([-1, "x"]) == [0, "x"]  # refused later by the check, not here
    with pytest.raises(SpecdecError, match="do not fit"):
        check_states(from_outputs(["x", 1, 2]), L, "ids", highest=L - 1, count=3)
