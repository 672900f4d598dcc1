"""What the four apps share: `errors` (exceptions -> gRPC status), `validation` (proto -> pydantic), `rpc` (the
handler wrapper), `ray_adapter` (every use of Ray's non-public API, in one place), `health` and `health_app`
(grpc.health.v1 on the proxy and on the health port), `metrics` (the genserve_* Prometheus series), `images` (PNG
and Tensor messages), `builder` (serve config -> app) and `deploy_config` (the serve configs' one source: the ports
and paths `make serve` reads, and the writer of deploy/serve_config*.yaml)."""
