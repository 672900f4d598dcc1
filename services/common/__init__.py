"""What the four apps share: `errors` (exceptions -> gRPC status), `validation` (proto -> pydantic), `rpc` (the
handler wrapper), `health` and `health_app` (grpc.health.v1 on the proxy and on the health port), `metrics`
(the genserve_* Prometheus series), `images` (PNG and Tensor messages), `builder` (serve config -> app),
`deploy_config` (writes deploy/serve_config*.yaml) and `protogen` (`make protos`)."""
