"""Model code shared by every genserve service: the building blocks (`shared.blocks`) and the checkpoint format
(`shared.checkpoint`). Nothing here imports Ray, gRPC or protobuf."""
