"""gRPC server reflection: a client without the .proto files lists the genserve services and their methods on the
gRPC port (the Serve proxy), and the health service on the health port."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from genserve.v1 import common_pb2, diffusion_pb2, gan_pb2, text_pb2, vae_pb2

pytestmark = pytest.mark.e2e

MODULES = (text_pb2, gan_pb2, vae_pb2, diffusion_pb2)


def listed(address: str) -> tuple[set[str], dict[str, set[str]]]:
    """The services reflection lists at `address`, and each one's methods as the reflected descriptors give them."""
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        pool = DescriptorPool(database)
        methods = {name: {m.name for m in pool.FindServiceByName(name).methods}
                   for name in services if name.startswith(("genserve.", "grpc.health."))}
    return services, methods


def test_reflection_lists_the_four_genserve_services_and_their_methods(stack) -> None:
    services, methods = listed(stack.address)
    for module in MODULES:
        (service,) = module.DESCRIPTOR.services_by_name.values()
        assert service.full_name in services
        assert methods[service.full_name] == {m.name for m in service.methods}
    assert "genserve.v1.ServeStatus" in services and methods["genserve.v1.ServeStatus"] == {"GetStatus"}
    assert methods["grpc.health.v1.Health"] >= {"Check"}
    assert common_pb2.DESCRIPTOR.services_by_name["ServeStatus"].full_name == "genserve.v1.ServeStatus"


def test_reflection_on_the_health_port(stack) -> None:
    services, methods = listed(stack.health_address)
    assert "grpc.health.v1.Health" in services and "Check" in methods["grpc.health.v1.Health"]
    assert not any(name.startswith("genserve.") for name in services)
