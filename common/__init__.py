"""What every BubbleSpec process shares: the SDK, the scheduler and the worker import it, and
it imports none of them (grpcio and protobuf only, like the SDK).

- ``types``: the plain data types (the SDK re-exports the public ones, ``bubblespec.client``);
- ``codec``: protobuf <-> those types, used at every edge;
- ``transport``: the gRPC channel options of every process that dials the scheduler;
- ``rules``: rules both sides of the worker stream apply alike (draft and resume seeds, the
  paying draft length).
"""
