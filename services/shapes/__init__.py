"""Captioned-shapes dataset and the attribute reader, the image models' quality metric."""
