"""genserve's services: one package per model family, each with its model code and a thin Ray Serve app.

- `services.text`, `services.gan`, `services.vae`, `services.diffusion`: the models (no Ray, no gRPC) and, in
  each `app.py`, the Ray Serve application that validates a protobuf request, calls the model and replies;
- `services.shapes`: the captioned-shapes dataset and the attribute reader that scores generated images;
- `services.common`: what the four apps share (errors -> gRPC status, validation, health, metrics, images, the
  app builder and the serve configs);
- `services.client`: the typed SDK and the `genserve` CLI; `services.serve`: `make serve`.
"""
