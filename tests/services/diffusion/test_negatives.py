"""The negative prompts of the negative-prompt benchmark (services/diffusion/negatives.py)."""

from __future__ import annotations

import numpy as np
import pytest

from genserve.services.diffusion.evaluate import heldout_prompts
from genserve.services.diffusion.negatives import contrasting_negative, contrasting_negatives, open_colour_prompt
from genserve.services.shapes.dataset import COLOURS, POSITIONS, SHAPES

ATTRS = {"shape": "square", "colour": "yellow", "size": "large", "position": "top left"}


@pytest.mark.parametrize("seed", range(20))
def test_each_kind_names_another_value_of_its_attribute(seed: int) -> None:
    rng = np.random.default_rng(seed)
    colour, shape = contrasting_negative(ATTRS, "colour", rng).split()[1:]
    assert colour in COLOURS and colour != "yellow" and shape == "square"
    colour, shape = contrasting_negative(ATTRS, "shape", rng).split()[1:]
    assert colour == "yellow" and shape in SHAPES and shape != "square"
    text = contrasting_negative(ATTRS, "position", rng)
    position = text.split(" the ", 1)[1]
    assert text.startswith("a square ") and position in POSITIONS and position != "top left"


def test_prompts_cycle_through_colour_shape_position_and_are_seeded() -> None:
    _, attrs = heldout_prompts(6, seed=0)
    negatives = contrasting_negatives(attrs, seed=0)
    assert negatives == contrasting_negatives(attrs, seed=0)
    for i, (text, a) in enumerate(zip(negatives, attrs, strict=True)):
        words = text.split()
        if i % 3 == 0:
            assert words[2] == a["shape"] and words[1] != a["colour"]
        elif i % 3 == 1:
            assert words[1] == a["colour"] and words[2] != a["shape"]
        else:
            assert words[1] == a["shape"] and not text.endswith(a["position"])
    with pytest.raises(ValueError, match="kind"):
        contrasting_negative(ATTRS, "size", np.random.default_rng(0))


def test_open_colour_prompt_leaves_the_colour_out() -> None:
    assert open_colour_prompt(ATTRS) == "a large square at the top left"
    assert open_colour_prompt({**ATTRS, "position": "center"}) == "a large square in the center"
