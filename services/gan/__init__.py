"""DCGAN generator/discriminator, sampling, training, weights."""
