"""Variational autoencoder: model, training, weights."""
