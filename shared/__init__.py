"""Model code shared by every genserve service: the building blocks (`genserve.shared.blocks`) and the checkpoint format
(`genserve.shared.checkpoint`). Nothing here imports Ray, gRPC or protobuf."""
