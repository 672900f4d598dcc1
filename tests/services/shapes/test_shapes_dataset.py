from __future__ import annotations

import numpy as np
import pytest
import torch

from genserve.services.shapes.dataset import (
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    all_attribute_combinations,
    attribute_subset,
    caption,
    parse_caption,
    partial_caption,
    render,
    sample_batch,
    to_tensor,
    to_uint8,
)


def test_same_seed_and_split_gives_identical_bytes():
    a, captions_a, attrs_a = sample_batch(16, seed=3)
    b, captions_b, attrs_b = sample_batch(16, seed=3)
    assert to_uint8(a).tobytes() == to_uint8(b).tobytes()
    assert captions_a == captions_b and attrs_a == attrs_b


def test_heldout_split_is_a_different_stream_from_train():
    train, _, _ = sample_batch(16, seed=3, split="train")
    heldout, _, _ = sample_batch(16, seed=3, split="heldout")
    assert not torch.equal(train, heldout)


def test_different_seeds_give_different_images():
    assert not torch.equal(sample_batch(8, seed=0)[0], sample_batch(8, seed=1)[0])


def test_batch_has_the_documented_shapes_and_range():
    images, captions, attrs = sample_batch(5, seed=0, split="heldout")
    assert images.shape == (5, 3, 32, 32) and images.dtype == torch.float32
    assert images.min() >= -1.0 and images.max() <= 1.0
    assert len(captions) == len(attrs) == 5


def test_vocabulary_meets_the_issue_minimums():
    assert len(SHAPES) >= 4 and {"circle", "square", "triangle"} <= set(SHAPES)
    assert len(COLOURS) >= 6 and len(SIZES) == 2 and len(POSITIONS) >= 5
    combos = all_attribute_combinations()
    assert len(combos) == len(SHAPES) * len(COLOURS) * len(SIZES) * len(POSITIONS)
    assert len({tuple(c.values()) for c in combos}) == len(combos)


def test_caption_round_trips_through_parse_for_every_combination():
    for attrs in all_attribute_combinations():
        assert parse_caption(caption(attrs)) == attrs


def test_caption_reads_like_the_issue_example():
    attrs = {"shape": "circle", "colour": "red", "size": "large", "position": "top left"}
    assert caption(attrs) == "a large red circle at the top left"
    assert parse_caption("A  large red circle at the TOP left") == attrs


@pytest.mark.parametrize("text", ["a huge red circle at the top left", "a red circle", "", "a large red circle"])
def test_parse_caption_rejects_text_outside_the_grammar(text):
    assert parse_caption(text) is None


def test_render_rejects_unknown_attribute():
    with pytest.raises(ValueError, match="shape"):
        render({"shape": "hexagon", "colour": "red", "size": "large", "position": "center"}, np.random.default_rng(0))


def test_render_paints_the_palette_colour_at_the_anchor_on_a_light_background():
    attrs = {"shape": "square", "colour": "blue", "size": "large", "position": "bottom right"}
    image = render(attrs, np.random.default_rng(0))
    x, y = (int(v) for v in POSITIONS["bottom right"])
    assert np.abs(image[y, x].astype(int) - np.array(COLOURS["blue"])).max() <= 10
    assert image[1, 1].min() >= 200  # the top-left corner is background


def test_uint8_tensor_conversion_round_trips():
    images = np.random.default_rng(0).integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_array_equal(to_uint8(to_tensor(images)), images)


def test_partial_caption_renders_any_subset_in_the_caption_grammar() -> None:
    attrs = {"size": "large", "colour": "green", "shape": "square", "position": "bottom right"}
    assert partial_caption(attrs) == caption(attrs) == "a large green square at the bottom right"
    assert partial_caption({"colour": "green", "shape": "square"}) == "a green square"
    assert partial_caption({"shape": "square", "position": "bottom right"}) == "a square at the bottom right"
    assert partial_caption({"size": "large", "shape": "circle", "position": "top left"}) == \
        "a large circle at the top left"
    assert partial_caption({"colour": "blue", "position": "center"}) == "a blue in the center"
    assert partial_caption({"position": "center"}) == "in the center"
    assert partial_caption({"size": "small"}) == "a small"
    assert partial_caption({}) == ""
    # None means "not named", as a reader's unreadable attribute does
    assert partial_caption({"colour": None, "shape": "cross"}) == "a cross"


def test_attribute_subset_masks_follow_caption_order() -> None:
    attrs = {"size": "small", "colour": "red", "shape": "cross", "position": "top right"}
    assert attribute_subset(attrs, 15) == attrs
    assert attribute_subset(attrs, 0b0110) == {"colour": "red", "shape": "cross"}
    assert attribute_subset(attrs, 0b1100) == {"shape": "cross", "position": "top right"}
    assert attribute_subset(attrs, 0b0001) == {"size": "small"}
    # every one of the 15 non-empty subsets renders to a distinct caption
    texts = {partial_caption(attribute_subset(attrs, m)) for m in range(1, 16)}
    assert len(texts) == 15 and "" not in texts
