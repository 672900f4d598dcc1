"""The text engine: paged KV cache, continuous-batching scheduler, sampler and incremental detokenizer.

Import each part from its own module (``from genserve.services.text.engine.params import SamplingParams``): this
package imports nothing, so the torch-free ones (``params``: what a request asks for and the request-level errors)
load without the model code, as the wire schemas (services/text/schema.py) and the HTTP ingress need.
"""
