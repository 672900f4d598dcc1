"""genserve's services (installed as `genserve.services`): one package per model family, each with its model code and
a thin Ray Serve app.

- `text`, `gan`, `vae`, `diffusion`: the models (no Ray, no gRPC) and, in each `app.py`, the Ray Serve application
  that validates a protobuf request, calls the model and replies;
- `shapes`: the captioned-shapes dataset and the attribute reader that scores generated images;
- `common`: what the four apps share (errors -> gRPC status, validation, health, metrics, images, the app builder and
  the serve configs);
- `client`: the typed SDK and the `genserve` CLI; `serve`: `make serve`.
"""
