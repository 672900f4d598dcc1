from __future__ import annotations

import numpy as np
import pytest
import torch

from genserve.services.shapes.dataset import all_attribute_combinations, render, sample_batch, to_tensor
from genserve.services.shapes.reader import accuracy, is_valid, read_attributes, read_batch


def test_reader_accuracy_on_heldout_images_is_at_least_98_percent():
    images, _, attrs = sample_batch(300, seed=11, split="heldout")
    scores = accuracy(read_batch(images), attrs)
    assert scores["all"] >= 0.98, scores


def test_reader_reads_every_attribute_combination():
    rng = np.random.default_rng(5)
    combos = all_attribute_combinations()
    read = [read_attributes(render(attrs, rng)) for attrs in combos]
    assert accuracy(read, combos)["all"] >= 0.98


def test_uint8_and_tensor_inputs_read_the_same():
    attrs = {"shape": "triangle", "colour": "orange", "size": "small", "position": "top right"}
    image = render(attrs, np.random.default_rng(1))
    assert read_attributes(image) == read_attributes(to_tensor(image[None])[0]) == attrs


def test_blank_image_reads_as_invalid():
    blank = np.full((32, 32, 3), 230, dtype=np.uint8)
    attrs = read_attributes(blank)
    assert attrs == {"shape": None, "colour": None, "size": None, "position": None}
    assert not is_valid(attrs)


def test_two_shapes_do_not_read_as_one_valid_shape():
    rng = np.random.default_rng(2)
    left = render({"shape": "square", "colour": "red", "size": "small", "position": "top left"}, rng)
    right = render({"shape": "square", "colour": "red", "size": "small", "position": "bottom right"}, rng)
    both = np.minimum(left, right)  # both squares on (almost) the same background
    assert read_attributes(both)["shape"] is None


def test_noise_does_not_read_as_a_valid_shape():
    noise = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert not is_valid(read_attributes(noise))


def test_non_palette_colour_reads_as_no_colour():
    attrs = {"shape": "circle", "colour": "red", "size": "large", "position": "center"}
    image = render(attrs, np.random.default_rng(3))
    shape_pixels = np.abs(image.astype(int) - image[0, 0].astype(int)).sum(-1) > 150
    image[shape_pixels] = (20, 20, 20)  # black is not in the palette
    assert read_attributes(image)["colour"] is None


def test_reader_rejects_wrong_input_shape():
    with pytest.raises(ValueError, match="uint8"):
        read_attributes(np.zeros((16, 16, 3), dtype=np.uint8))


def test_accuracy_counts_each_attribute():
    expected = [{"shape": "circle", "colour": "red", "size": "small", "position": "center"}] * 2
    read = [dict(expected[0]), dict(expected[0], colour="blue")]
    assert accuracy(read, expected) == {"shape": 1.0, "colour": 0.5, "size": 1.0, "position": 1.0, "all": 0.5}
